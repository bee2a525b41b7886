// Reading one record of the kill topic: any bytes in, a signal out or a BadSignal saying why not.
//
// The contract is schemas/kill-signal.schema.json, read strictly (see tests/support/
// signal_vectors.py for the rules); every spanguard killswitch decides the shared vectors in
// schemas/testdata/kill-signal-vectors.json alike.

import { createHmac, timingSafeEqual } from 'node:crypto';

import {
  JsonError,
  RawNumber,
  canonicalJson,
  depthOf,
  hasLoneSurrogate,
  isPlainObject,
  parseStrict,
} from './json.js';

export const MAX_SIGNAL_BYTES = 64 * 1024;
export const MAX_SIGNAL_DEPTH = 8;
export const KILL_SIGNAL_SCHEMA_VERSION = 2;
// Kinds of bad records: the format ones count as malformed, the signature ones as rejected.
export const MALFORMED_KINDS = new Set(['empty', 'too_large', 'not_utf8', 'not_json', 'too_deep', 'not_object', 'invalid']);
export const REJECTED_KINDS = new Set(['unsigned', 'unknown_key', 'forged']);

const KEY_ID_TEXT = 'spanguard kill-signal key id';
const HEX32 = /^[0-9a-f]{32}$/;
const HEX16 = /^[0-9a-f]{16}$/;
// RFC 3339 with a zone; at most 6 fractional digits (what every reader keeps exactly).
const DATE_TIME = /^([0-9]{4})-([0-9]{2})-([0-9]{2})T([0-9]{2}):([0-9]{2}):([0-9]{2})(\.[0-9]{1,6})?(Z|[+-]([0-9]{2}):([0-9]{2}))$/;
const KINDS = new Set(['kill', 'downgrade', 'release', 'pause']);
const PAUSE_FALLBACKS = new Set(['kill', 'release']);
const RULES = new Set(['tool_loop', 'cycle', 'tool_polling', 'no_progress', 'token_budget', 'cost_budget', 'handoff_cycle', 'delegation_depth', 'agent_fan_out', 'agent_budget', 'manual', 'tool_failing', 'loop_signature']);
// What a signal stops: its trace (also when absent), every trace of a conversation, or of an
// agent; or the tool it contains (every call to it refused, the agent goes on).
const SCOPES = new Set(['trace', 'conversation', 'agent', 'tool']);
const MAX_CONVERSATION_ID_CHARS = 200;
const MAX_TOOL_NAME_CHARS = 200;
// The fleet rules: their signals contain a tool, and their release is the tool's recovery.
const FLEET_RULES = new Set(['tool_failing', 'loop_signature']);
const TOP_FIELDS = new Set([
  'schema_version', 'signal_id', 'trace_id', 'kind', 'rule', 'reason', 'evidence', 'agent',
  'detected_at', 'expires_at', 'system_message', 'operator', 'pause_until', 'pause_fallback',
  'scope', 'conversation_id', 'tool', 'key_id', 'signature',
]);
const REQUIRED = ['schema_version', 'signal_id', 'trace_id', 'kind', 'rule', 'reason', 'evidence', 'agent', 'detected_at', 'expires_at'];
// evidence field -> its minimum (integers) or 'string' / 'hex16'
const EVIDENCE = {
  span_id: 'hex16',
  tool_name: 'string',
  args_hash: 'hex16',
  result_hash: 'hex16',
  hits: 1,
  window: 1,
  steps: 1,
  tokens: 0,
  token_budget: 1,
  cost_micro_usd: 0, // money in whole micro-dollars (1e-6 USD)
  budget_micro_usd: 1,
};

/** A record on the kill topic that is not a signal this agent may act on. */
export class BadSignal extends Error {
  constructor(kind, detail) {
    // The detail quotes attacker-controlled text: keep it short and printable.
    const printable = String(detail).replace(/[^\x20-\x7e]/g, '?').slice(0, 200);
    super(`${kind}: ${printable}`);
    this.kind = kind;
    this.detail = printable;
  }
}

function toBytes(key) {
  if (typeof key === 'string') return Buffer.from(key, 'utf8');
  return Buffer.from(key);
}

/** The id a signed signal names its key by: 16 hex chars of HMAC-SHA256(key, fixed text). */
export function keyId(key) {
  return createHmac('sha256', toBytes(key)).update(KEY_ID_TEXT).digest('hex').slice(0, 16);
}

/** Map of key id -> key bytes, for one key or several (strings are UTF-8). */
export function keyring(keys) {
  const list = typeof keys === 'string' || keys instanceof Uint8Array ? [keys] : [...keys];
  const ring = new Map();
  for (const key of list) {
    const raw = toBytes(key);
    if (raw.length === 0) throw new Error('a signing key must not be empty');
    ring.set(keyId(raw), raw);
  }
  return ring;
}

/** `record` with its key's key_id and an HMAC-SHA256 signature (hex) over its canonical JSON. */
export function sign(record, key) {
  const named = { ...record, key_id: keyId(key) };
  delete named.signature;
  const signature = createHmac('sha256', toBytes(key)).update(canonicalJson(named), 'utf8').digest('hex');
  return { ...named, signature };
}

/** 'valid', 'unsigned', 'unknown_key' or 'forged' for `record` against `keys` (a keyring). */
export function verify(record, keys) {
  if (!('signature' in record)) return 'unsigned';
  const key = keys.get(record.key_id);
  if (key === undefined) return 'unknown_key';
  const unsigned = { ...record };
  delete unsigned.signature;
  const expected = Buffer.from(createHmac('sha256', key).update(canonicalJson(unsigned), 'utf8').digest('hex'));
  const given = Buffer.from(record.signature, 'utf8');
  return given.length === expected.length && timingSafeEqual(given, expected) ? 'valid' : 'forged';
}

/** Milliseconds since the epoch of an RFC 3339 date-time with a zone, or null if it is not one
 * or names a day or time that does not exist. */
export function parseDateTime(text) {
  if (typeof text !== 'string') return null;
  const match = DATE_TIME.exec(text);
  if (match === null) return null;
  const [, y, mo, d, h, mi, s, fraction, zone, zh, zm] = match;
  const year = Number(y);
  const month = Number(mo);
  const day = Number(d);
  if (month < 1 || month > 12 || day < 1 || day > daysIn(year, month)) return null;
  if (Number(h) > 23 || Number(mi) > 59 || Number(s) > 59) return null;
  let offsetMinutes = 0;
  if (zone !== 'Z') {
    if (Number(zh) > 23 || Number(zm) > 59) return null;
    offsetMinutes = (zone[0] === '-' ? -1 : 1) * (Number(zh) * 60 + Number(zm));
  }
  const micros = fraction ? Number(fraction.slice(1).padEnd(6, '0')) : 0;
  const utc = Date.UTC(year, month - 1, day, Number(h), Number(mi), Number(s));
  // Whole milliseconds and the microseconds beyond them, so no precision is lost comparing.
  return { ms: utc - offsetMinutes * 60_000 + Math.floor(micros / 1000), micros: micros % 1000 };
}

function daysIn(year, month) {
  return new Date(Date.UTC(year, month, 0)).getUTCDate();
}

function isInteger(value, minimum) {
  return typeof value === 'number' && Number.isSafeInteger(value) && value >= minimum;
}

function invalid(where, message) {
  throw new BadSignal('invalid', `field ${where}: ${message}`);
}

/** Throws BadSignal('invalid') unless `record` keeps schemas/kill-signal.schema.json strictly. */
function checkSchema(record) {
  for (const name of REQUIRED) {
    if (!(name in record)) invalid('(top level)', `'${name}' is a required property`);
  }
  for (const name of Object.keys(record)) {
    if (!TOP_FIELDS.has(name)) invalid('(top level)', `additional property '${name}'`);
  }
  if (record.schema_version !== KILL_SIGNAL_SCHEMA_VERSION) invalid('schema_version', 'must be 2');
  if (typeof record.signal_id !== 'string' || !HEX32.test(record.signal_id)) invalid('signal_id', 'not 32 lowercase hex');
  if (typeof record.trace_id !== 'string' || !HEX32.test(record.trace_id)) invalid('trace_id', 'not 32 lowercase hex');
  if (!KINDS.has(record.kind)) invalid('kind', 'not kill, downgrade, release or pause');
  if (!RULES.has(record.rule)) invalid('rule', 'not a rule');
  if (typeof record.reason !== 'string' || record.reason.length === 0) invalid('reason', 'not a non-empty string');
  const evidence = record.evidence;
  if (!isPlainObject(evidence)) invalid('evidence', 'not an object');
  if (!('span_id' in evidence)) invalid('evidence', "'span_id' is a required property");
  for (const [name, value] of Object.entries(evidence)) {
    const rule = EVIDENCE[name];
    if (rule === undefined) invalid('evidence', `additional property '${name}'`);
    if (rule === 'string' ? typeof value !== 'string' : rule === 'hex16' ? typeof value !== 'string' || !HEX16.test(value) : !isInteger(value, rule)) {
      invalid(`evidence.${name}`, 'wrong type or value');
    }
  }
  const agent = record.agent;
  if (!isPlainObject(agent)) invalid('agent', 'not an object');
  if (typeof agent.service !== 'string') invalid('agent.service', 'not a string');
  for (const name of Object.keys(agent)) {
    if (name !== 'service' && name !== 'name') invalid('agent', `additional property '${name}'`);
  }
  if ('name' in agent && agent.name !== null && typeof agent.name !== 'string') invalid('agent.name', 'not a string or null');
  for (const name of ['detected_at', 'expires_at']) {
    if (parseDateTime(record[name]) === null) invalid(name, 'not an RFC 3339 date-time with a zone');
  }
  if ('system_message' in record && record.system_message !== null && typeof record.system_message !== 'string') {
    invalid('system_message', 'not a string or null');
  }
  if (record.kind === 'downgrade' && typeof record.system_message !== 'string') invalid('system_message', 'a downgrade carries one');
  if ('operator' in record && (typeof record.operator !== 'string' || record.operator.length === 0)) invalid('operator', 'not a non-empty string');
  const recovery = record.scope === 'tool' && FLEET_RULES.has(record.rule);
  if (record.kind === 'release' && !recovery && (record.rule !== 'manual' || !('operator' in record))) {
    invalid('kind', 'a release is manual and names its operator');
  }
  if ('pause_until' in record && parseDateTime(record.pause_until) === null) {
    invalid('pause_until', 'not an RFC 3339 date-time with a zone');
  }
  if ('pause_fallback' in record && !PAUSE_FALLBACKS.has(record.pause_fallback)) invalid('pause_fallback', 'not kill or release');
  if (record.kind === 'pause' && !('pause_until' in record && 'pause_fallback' in record)) {
    invalid('kind', 'a pause carries pause_until and pause_fallback');
  }
  if ('scope' in record && !SCOPES.has(record.scope)) invalid('scope', 'not trace, conversation, agent or tool');
  checkTool(record);
  if ('conversation_id' in record) {
    const id = record.conversation_id;
    // JSON Schema's maxLength counts characters (code points), not UTF-16 units.
    if (typeof id !== 'string' || id.length === 0 || [...id].length > MAX_CONVERSATION_ID_CHARS) {
      invalid('conversation_id', `not a string of 1 to ${MAX_CONVERSATION_ID_CHARS} characters`);
    }
  }
  if ((record.scope === 'conversation') !== ('conversation_id' in record)) {
    invalid('conversation_id', 'a conversation signal, and only it, names its conversation');
  }
  if (record.scope === 'agent' && agent.service.length === 0) invalid('agent.service', 'an agent signal names its service');
  if (['conversation', 'agent', 'tool'].includes(record.scope) && record.kind !== 'kill' && record.kind !== 'release') {
    invalid('kind', 'a scoped signal is a kill or a release');
  }
  if ('key_id' in record !== 'signature' in record) invalid('(top level)', 'key_id and signature go together');
  if ('key_id' in record && (typeof record.key_id !== 'string' || !HEX16.test(record.key_id))) invalid('key_id', 'not 16 lowercase hex');
  if ('signature' in record && typeof record.signature !== 'string') invalid('signature', 'not a string');
}

function isBoundedString(value, minimum) {
  // JSON Schema's lengths count characters (code points), not UTF-16 units.
  return typeof value === 'string' && [...value].length >= minimum && [...value].length <= MAX_TOOL_NAME_CHARS;
}

/** A tool signal names its tool ({name, server}), and only it; fleet rules only contain tools. */
function checkTool(record) {
  if ('tool' in record) {
    const tool = record.tool;
    if (!isPlainObject(tool)) invalid('tool', 'not an object');
    for (const name of ['name', 'server']) {
      if (!(name in tool)) invalid('tool', `'${name}' is a required property`);
    }
    for (const name of Object.keys(tool)) {
      if (name !== 'name' && name !== 'server') invalid('tool', `additional property '${name}'`);
    }
    if (!isBoundedString(tool.name, 1)) invalid('tool.name', `not a string of 1 to ${MAX_TOOL_NAME_CHARS} characters`);
    if (!isBoundedString(tool.server, 0)) invalid('tool.server', `not a string of at most ${MAX_TOOL_NAME_CHARS} characters`);
  }
  if ((record.scope === 'tool') !== ('tool' in record)) invalid('tool', 'a tool signal, and only it, names its tool');
  if (record.scope === 'tool' && !FLEET_RULES.has(record.rule) && record.rule !== 'manual') {
    invalid('rule', 'a tool signal is a fleet rule\'s or manual');
  }
  if (FLEET_RULES.has(record.rule) && record.scope !== 'tool') invalid('scope', 'a fleet rule contains a tool');
}

const UTF8 = new TextDecoder('utf-8', { fatal: true, ignoreBOM: true });

/**
 * The kill signal in `value` (bytes), or throws BadSignal naming the kind of bad record.
 * `keys`: a keyring (see keyring()) the signal must be signed with; null obeys unsigned signals.
 * `now`: a Date, deciding expiry.
 */
export function readSignal(value, keys, now = new Date()) {
  if (value === null || value === undefined || value.length === 0) throw new BadSignal('empty', 'no value');
  if (value.length > MAX_SIGNAL_BYTES) throw new BadSignal('too_large', `${value.length} bytes (at most ${MAX_SIGNAL_BYTES})`);
  let text;
  try {
    text = UTF8.decode(value);
  } catch (error) {
    throw new BadSignal('not_utf8', error.message);
  }
  let record;
  try {
    record = parseStrict(text);
  } catch (error) {
    if (error instanceof JsonError) throw new BadSignal(error.kind, error.message);
    throw error;
  }
  if (!isPlainObject(record)) {
    throw new BadSignal('not_object', `a JSON ${Array.isArray(record) ? 'list' : record instanceof RawNumber ? 'number' : typeof record}, not an object`);
  }
  if (depthOf(record) > MAX_SIGNAL_DEPTH) throw new BadSignal('too_deep', `nested more than ${MAX_SIGNAL_DEPTH} levels`);
  if (hasLoneSurrogate(record)) throw new BadSignal('not_utf8', 'a string holds a lone surrogate escape');
  checkSchema(record);
  if (keys !== null && keys !== undefined) {
    const check = verify(record, keys);
    if (check !== 'valid') {
      let detail = `signal for trace ${record.trace_id}`;
      if (check === 'unknown_key') detail += `, signed with key id ${record.key_id}, not one of this agent's`;
      throw new BadSignal(check, detail);
    }
  }
  const expires = parseDateTime(record.expires_at);
  const nowMs = now.getTime();
  if (nowMs > expires.ms || (nowMs === expires.ms && expires.micros === 0)) {
    throw new BadSignal('expired', `signal for trace ${record.trace_id} expired at ${record.expires_at}`);
  }
  return Object.freeze({
    signalId: record.signal_id,
    traceId: record.trace_id,
    kind: record.kind,
    rule: record.rule,
    reason: record.reason,
    evidence: { ...record.evidence },
    agent: { service: record.agent.service, name: record.agent.name ?? null },
    detectedAt: record.detected_at,
    expiresAt: record.expires_at,
    systemMessage: record.system_message ?? null,
    operator: record.operator ?? null,
    pauseUntil: record.pause_until ?? null, // kind pause: until when the agent waits
    pauseFallback: record.pause_fallback ?? null, // and then: 'kill' or 'release'
    scope: record.scope ?? null, // null or 'trace': the trace; 'conversation'; 'agent'
    conversationId: record.conversation_id ?? null,
    // scope 'tool': the tool contained or released ({name, server}; server '' when none)
    tool: record.tool ? Object.freeze({ name: record.tool.name, server: record.tool.server }) : null,
  });
}
