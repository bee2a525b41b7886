// A strict JSON reader for kill-signal records.
//
// JSON.parse keeps the last of duplicate keys, rounds integers beyond 2**53 and accepts lone
// surrogate escapes; another language's parser may keep the first key or the exact integer.
// A record that parsers read differently must be refused by every killswitch alike
// (schemas/testdata/kill-signal-vectors.json), so this reader refuses duplicate keys, keeps
// every number that is not a safe integer as a RawNumber (the schema then refuses it), and
// leaves lone surrogates for the caller to find.

export const MAX_PARSE_DEPTH = 512;

export class JsonError extends Error {
  constructor(kind, message) {
    super(message);
    this.kind = kind; // 'not_json' or 'too_deep'
  }
}

/** A number that is not an integer within +-(2**53 - 1), as written. */
export class RawNumber {
  constructor(text) {
    this.text = text;
  }
}

const NUMBER = /-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?/y;
const INTEGER = /^-?(?:0|[1-9][0-9]*)$/;

/** Parse `text` (a string) strictly; throws JsonError. */
export function parseStrict(text) {
  let at = 0;

  const fail = (what) => {
    throw new JsonError('not_json', `${what} at offset ${at}`);
  };
  const skipSpace = () => {
    while (at < text.length) {
      const c = text.charCodeAt(at);
      if (c === 0x20 || c === 0x09 || c === 0x0a || c === 0x0d) at++;
      else break;
    }
  };

  const parseString = () => {
    at++; // the opening quote
    let out = '';
    let start = at;
    for (;;) {
      if (at >= text.length) fail('unterminated string');
      const c = text.charCodeAt(at);
      if (c === 0x22) {
        out += text.slice(start, at);
        at++;
        return out;
      }
      if (c < 0x20) fail('control character in a string');
      if (c !== 0x5c) {
        at++;
        continue;
      }
      out += text.slice(start, at);
      const escape = text[at + 1];
      at += 2;
      switch (escape) {
        case '"':
          out += '"';
          break;
        case '\\':
          out += '\\';
          break;
        case '/':
          out += '/';
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'n':
          out += '\n';
          break;
        case 'r':
          out += '\r';
          break;
        case 't':
          out += '\t';
          break;
        case 'u': {
          const hex = text.slice(at, at + 4);
          if (!/^[0-9a-fA-F]{4}$/.test(hex)) fail('bad \\u escape');
          out += String.fromCharCode(parseInt(hex, 16)); // a lone surrogate stays lone
          at += 4;
          break;
        }
        default:
          fail('bad escape');
      }
      start = at;
    }
  };

  const parseValue = (depth) => {
    skipSpace();
    if (at >= text.length) fail('unexpected end');
    const c = text[at];
    if (c === '{' || c === '[') {
      if (depth >= MAX_PARSE_DEPTH) throw new JsonError('too_deep', 'nested too deeply to decode');
      return c === '{' ? parseObject(depth + 1) : parseArray(depth + 1);
    }
    if (c === '"') return parseString();
    if (text.startsWith('true', at)) {
      at += 4;
      return true;
    }
    if (text.startsWith('false', at)) {
      at += 5;
      return false;
    }
    if (text.startsWith('null', at)) {
      at += 4;
      return null;
    }
    NUMBER.lastIndex = at;
    const match = NUMBER.exec(text);
    if (match === null || match[0] === '-') fail('unexpected character');
    at += match[0].length;
    const literal = match[0];
    if (INTEGER.test(literal)) {
      const value = Number(literal);
      if (Number.isSafeInteger(value)) return value === 0 ? 0 : value; // -0 is 0
    }
    return new RawNumber(literal);
  };

  // Consumes c when it comes next.
  const eat = (c) => {
    if (text[at] !== c) return false;
    at++;
    return true;
  };

  // What follows a container's member: true after a comma, false after the container's close.
  const more = (close) => {
    skipSpace();
    if (eat(',')) return true;
    if (!eat(close)) fail(`expected ',' or '${close}'`);
    return false;
  };

  const parseObject = (depth) => {
    at++;
    const out = Object.create(null);
    skipSpace();
    if (eat('}')) return out;
    for (;;) {
      skipSpace();
      if (text[at] !== '"') fail('expected a key');
      const key = parseString();
      if (Object.prototype.hasOwnProperty.call(out, key)) fail(`duplicate key ${JSON.stringify(key)}`);
      skipSpace();
      if (!eat(':')) fail("expected ':'");
      out[key] = parseValue(depth);
      if (!more('}')) return out;
    }
  };

  const parseArray = (depth) => {
    at++;
    const out = [];
    skipSpace();
    if (eat(']')) return out;
    for (;;) {
      out.push(parseValue(depth));
      if (!more(']')) return out;
    }
  };

  const value = parseValue(0);
  skipSpace();
  if (at !== text.length) fail('extra data after the document');
  return value;
}

export function isPlainObject(value) {
  return value !== null && typeof value === 'object' && !Array.isArray(value) && !(value instanceof RawNumber);
}

/** How deeply containers nest in `value` (1 for a flat object). */
export function depthOf(value) {
  let deepest = 0;
  const stack = [[value, 1]];
  while (stack.length) {
    const [node, depth] = stack.pop();
    let children;
    if (Array.isArray(node)) children = node;
    else if (isPlainObject(node)) children = Object.values(node);
    else continue;
    deepest = Math.max(deepest, depth);
    for (const child of children) stack.push([child, depth + 1]);
  }
  return deepest;
}

/** Whether any string in `value` (keys included) holds a lone surrogate. */
export function hasLoneSurrogate(value) {
  const stack = [value];
  while (stack.length) {
    const node = stack.pop();
    if (typeof node === 'string') {
      if (!node.isWellFormed()) return true;
    } else if (Array.isArray(node)) {
      stack.push(...node);
    } else if (isPlainObject(node)) {
      for (const [key, item] of Object.entries(node)) {
        if (!key.isWellFormed()) return true;
        stack.push(item);
      }
    }
  }
  return false;
}

/** The canonical JSON a signature covers: keys sorted by code point, no spaces, only quote,
 * backslash and control characters escaped (Python's json.dumps with ensure_ascii=False). */
export function canonicalJson(value) {
  if (value === null) return 'null';
  if (typeof value === 'boolean') return value ? 'true' : 'false';
  if (typeof value === 'number') {
    if (!Number.isSafeInteger(value)) throw new TypeError('only safe integers are canonical');
    return String(value);
  }
  if (typeof value === 'string') return quote(value);
  if (value instanceof RawNumber) throw new TypeError('a raw number has no canonical form');
  if (Array.isArray(value)) return `[${value.map(canonicalJson).join(',')}]`;
  const keys = Object.keys(value).sort(byCodePoint);
  return `{${keys.map((key) => `${quote(key)}:${canonicalJson(value[key])}`).join(',')}}`;
}

function byCodePoint(a, b) {
  const left = [...a];
  const right = [...b];
  for (let i = 0; i < Math.min(left.length, right.length); i++) {
    const diff = left[i].codePointAt(0) - right[i].codePointAt(0);
    if (diff !== 0) return diff;
  }
  return left.length - right.length;
}

const SHORT_ESCAPES = { '"': '\\"', '\\': '\\\\', '\n': '\\n', '\r': '\\r', '\t': '\\t', '\b': '\\b', '\f': '\\f' };

function quote(text) {
  // eslint-disable-next-line no-control-regex
  return `"${text.replace(/["\\\u0000-\u001f]/g, (c) => SHORT_ESCAPES[c] ?? `\\u${c.charCodeAt(0).toString(16).padStart(4, '0')}`)}"`;
}
