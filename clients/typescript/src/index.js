// spanguard's killswitch for JavaScript and TypeScript agents (types in index.d.ts).
export { AgentKilled, AgentPaused, DEFAULT_MAX_TRACES, SignalBook, ToolContained } from './book.js';
export { guardTools, spanguardCallbackHandler } from './hooks.js';
export {
  KillSwitch,
  SettingsError,
  agentOf,
  currentAgent,
  currentConversationId,
  currentTraceId,
  parseAgent,
} from './killswitch.js';
export { KafkaSecurityError, kafkajsSecurity, securityFromEnv } from './security.js';
export {
  BadSignal,
  MALFORMED_KINDS,
  MAX_SIGNAL_BYTES,
  REJECTED_KINDS,
  keyId,
  keyring,
  readSignal,
  sign,
  verify,
} from './signal.js';
export { canonicalJson } from './json.js';
export {
  DOWNGRADE_EVENT,
  EXIT_KILLED,
  STOP_EVENT,
  exitOnStop,
  findStop,
  recordOnActiveSpan,
  stopAttributes,
  stopReason,
} from './stop.js';
