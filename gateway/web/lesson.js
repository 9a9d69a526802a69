// Lesson phrases: Portuguese with its English meaning, and English with its Portuguese meaning.
// Each is a button (the one being spoken carries the class `playing`, its words are highlighted as they are
// heard) with a "slower" button beside it that plays it again at a slow rate.

export const PHRASES = [
  { lang: 'pt', text: 'Bom dia! Como você está?', meaning: 'Good morning! How are you?' },
  { lang: 'en', text: 'Good morning! How are you?', meaning: 'Bom dia! Como você está?' },
  { lang: 'pt', text: 'Eu me chamo Ana. E você?', meaning: 'My name is Ana. And you?' },
  { lang: 'en', text: 'Nice to meet you!', meaning: 'Muito prazer!' },
  { lang: 'pt', text: 'Onde fica a estação?', meaning: 'Where is the station?' },
  { lang: 'en', text: 'Thank you, see you tomorrow.', meaning: 'Obrigado, até amanhã.' },
];

/** The `prefetch` messages of the lesson's script, one per route (`phraseRoute`: a line is made by the voice
 *  and language its `speak` will name): the gateway makes the lines its phrase cache lacks while the engine has
 *  room, so each button starts without an engine request (each answered by `prefetched`). */
export function prefetchMessages(voice, served) {
  const byRoute = new Map();
  for (const phrase of PHRASES) {
    const route = phraseRoute(phrase, voice, served);
    const key = `${route.voice ?? ''}|${route.language ?? ''}`;
    if (!byRoute.has(key)) byRoute.set(key, { type: 'prefetch', texts: [], ...withoutEmpty(route) });
    byRoute.get(key).texts.push(phrase.text);
  }
  return [...byRoute.values()];
}

const withoutEmpty = (route) => Object.fromEntries(Object.entries(route).filter(([, value]) => value));

const LANGUAGE_NAMES = { pt: 'Português', en: 'English' };

const primary = (tag) => tag.toLowerCase().split('-')[0];

/** How a phrase is spoken: where the gateway serves several languages (`served.languages`, BCP-47, from
 *  GET /v1/voices), a phrase goes to a model of its own language: with the chosen voice if that voice speaks it
 *  (`served.voiceLanguages`), else with that language's default voice (`language` alone). Otherwise: the voice. */
export function phraseRoute(phrase, voice, served) {
  const tag = served.languages.find((candidate) => primary(candidate) === phrase.lang);
  if (!tag || served.languages.length < 2) return { voice };
  const spoken = served.voiceLanguages[voice];
  return spoken && primary(spoken) === phrase.lang ? { voice, language: tag } : { language: tag };
}

export const SLOW_RATE = 0.7;

/** The page remembers each phrase's last recording on the server (`lastId`, for "Slower"); those recordings go
 *  with the session, so after it "Slower" says the phrase anew instead of asking for one the server lost. */
export function forgetRecordings() {
  for (const phrase of PHRASES) phrase.lastId = null;
}

/** Fill `list` with one button per phrase; `onPick(phrase, button)` / `onSlower(phrase, button)` on click. */
export function renderPhrases(list, onPick, onSlower) {
  list.replaceChildren(...PHRASES.map((phrase, index) => {
    const button = document.createElement('button');
    button.type = 'button';
    button.className = 'phrase';
    button.dataset.index = String(index);
    button.lang = phrase.lang;
    const tag = document.createElement('span');
    tag.className = `tag tag-${phrase.lang}`;
    tag.textContent = phrase.lang.toUpperCase();
    tag.title = LANGUAGE_NAMES[phrase.lang];
    const text = document.createElement('span');
    text.className = 'text';
    text.textContent = phrase.text;
    const meaning = document.createElement('span');
    meaning.className = 'meaning';
    meaning.textContent = phrase.meaning;
    const words = document.createElement('span');
    words.className = 'words';
    words.append(text, meaning);
    button.append(tag, words);
    button.addEventListener('click', () => onPick(phrase, button));
    const slower = document.createElement('button');
    slower.type = 'button';
    slower.className = 'slower';
    slower.textContent = 'Slower';
    slower.title = `Repeat slowly (${SLOW_RATE}×)`;
    slower.setAttribute('aria-label', `Repeat slowly: ${phrase.text}`);
    slower.addEventListener('click', () => onSlower(phrase, button));
    const item = document.createElement('li');
    item.className = 'phrase-row';
    item.append(button, slower);
    return item;
  }));
}
