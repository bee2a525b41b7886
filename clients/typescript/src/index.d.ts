// Types of @spanguard/killswitch (the package is plain ES modules; these describe its API).

export interface KillSignal {
  readonly signalId: string;
  readonly traceId: string;
  readonly kind: 'kill' | 'downgrade' | 'release' | 'pause';
  readonly rule: 'tool_loop' | 'cycle' | 'tool_polling' | 'no_progress' | 'token_budget' | 'cost_budget' | 'handoff_cycle' | 'delegation_depth' | 'agent_fan_out' | 'agent_budget' | 'manual' | 'tool_failing' | 'loop_signature';
  readonly reason: string;
  readonly evidence: Record<string, string | number>;
  readonly agent: { service: string; name: string | null };
  readonly detectedAt: string;
  readonly expiresAt: string;
  readonly systemMessage: string | null;
  readonly operator: string | null;
  /** kind pause: until when the agent waits for an operator (RFC 3339). */
  readonly pauseUntil: string | null;
  /** kind pause: what applies at pauseUntil. */
  readonly pauseFallback: 'kill' | 'release' | null;
  /** What it stops: null or 'trace' its trace; 'conversation' every trace of conversationId;
   * 'agent' every trace of `agent` (a null name: every agent of the service); 'tool' every
   * call to `tool` (it contains the tool: the agent goes on). */
  readonly scope: 'trace' | 'conversation' | 'agent' | 'tool' | null;
  readonly conversationId: string | null;
  /** scope 'tool': the tool contained or released (server '' when none: every server). */
  readonly tool: { readonly name: string; readonly server: string } | null;
}

export interface WaitOptions {
  /** Give up after this long: rejects with AgentPaused again. */
  timeoutMs?: number;
  /** Give up once this aborts: rejects with AgentPaused again. */
  signal?: AbortSignal;
}

/** Anything an agent can check before a tool call: a KillSwitch or a SignalBook. A checker
 * with wait() lets the hooks wait through a pause; without it, AgentPaused stops the run. */
export interface Checker {
  check(traceId: string, scope?: CheckScope): string | null;
  wait?(traceId: string, options?: WaitOptions): Promise<string | null>;
  /** Told by the hooks of a tool call with no trace to check (a KillSwitch counts and warns). */
  noteUnguarded?(where: string, whatToDo: string): void;
  /** Throws ToolContained if the tool is contained (the hooks call it where no trace is found). */
  checkTool?(tool: string, server?: string | null): void;
}

export class AgentKilled extends Error {
  readonly signal: KillSignal;
  readonly traceId: string;
  readonly reason: string;
  /** What the kill stops: the trace, its conversation or its agent. */
  readonly scope: 'trace' | 'conversation' | 'agent' | 'tool';
  /** The rule that decided, the action ('kill') and the worker's decision id. */
  readonly rule: string;
  readonly action: string;
  readonly decisionId: string;
}

/** Thrown by a check naming a tool that spanguard contained: the call is refused, not the
 * agent (the hooks let the framework hand the model its message as the tool's error). */
export class ToolContained extends AgentKilled {
  readonly tool: string;
  /** The contain's server ('' when it names none). */
  readonly server: string;
  readonly action: 'contain';
}

/** Who is checking, beyond the trace: a conversation or agent kill stops every trace of it. */
export interface CheckScope {
  /** The tool about to be called: a contained one throws ToolContained. */
  tool?: string | null;
  /** Its server, when known (absent: a contain of the tool on any server holds). */
  server?: string | null;
  conversationId?: string | null;
  /** An agent's identity; a kill with a null name stops every agent of the service. */
  agent?: { service: string; name?: string | null } | null;
}

/** Thrown by check() on a paused trace: wait() for an operator's release or kill, or until
 * `until`, when `fallback` applies. */
export class AgentPaused extends Error {
  readonly signal: KillSignal;
  readonly traceId: string;
  readonly reason: string;
  readonly until: string;
  readonly fallback: 'kill' | 'release';
  readonly scope: 'trace' | 'conversation' | 'agent';
  readonly rule: string;
  readonly action: 'pause';
  readonly decisionId: string;
}

export const DEFAULT_MAX_TRACES: number;

export class SignalBook implements Checker {
  /** clock: decides when a pause's deadline has come (default: the system time). */
  constructor(maxTraces?: number, options?: { clock?: () => Date });
  readonly delivered: number;
  readonly duplicates: number;
  readonly trackedTraces: number;
  /** Calls refused because their tool was contained. */
  readonly toolCallsRefused: number;
  deliver(signal: KillSignal): boolean;
  check(traceId: string, scope?: CheckScope): string | null;
  checkScopes(scope?: CheckScope): void;
  checkTool(tool: string, server?: string | null): void;
  /** The contain in force for the tool, or null. */
  contained(tool: string, server?: string | null): KillSignal | null;
  wait(traceId: string, options?: WaitOptions): Promise<string | null>;
  isKilled(traceId: string): boolean;
  forget(traceId: string): void;
}

export interface KafkaSecurity {
  securityProtocol?: 'PLAINTEXT' | 'SSL' | 'SASL_PLAINTEXT' | 'SASL_SSL';
  sslCaLocation?: string;
  sslCertificateLocation?: string;
  sslKeyLocation?: string;
  sslKeyPassword?: string;
  sslEndpointIdentificationAlgorithm?: 'https' | 'none';
  saslMechanism?: 'PLAIN' | 'SCRAM-SHA-256' | 'SCRAM-SHA-512';
  saslUsername?: string;
  saslPassword?: string;
}

export class KafkaSecurityError extends Error {}
export function securityFromEnv(environ?: Record<string, string | undefined>): KafkaSecurity;
export function kafkajsSecurity(security: KafkaSecurity): { ssl?: object; sasl?: object };

export class SettingsError extends Error {}

export interface KillSwitchOptions {
  brokers: string | string[];
  topic?: string;
  signingKey?: string | Uint8Array;
  signingKeys?: Array<string | Uint8Array>;
  /** INSECURE: obey unsigned signals. */
  allowUnsigned?: boolean;
  signals?: SignalBook;
  security?: KafkaSecurity;
  clock?: () => Date;
  /** This process's conversation, for every check (else read from OpenTelemetry baggage). */
  conversationId?: string;
  /** This process's agent, {service, name} or 'SERVICE[/NAME]', for every check. */
  agent?: { service: string; name?: string | null } | string;
  /** The resource the agent's TracerProvider was built with (@opentelemetry/resources): its
   * service.name and gen_ai.agent.name name the agent when neither a check nor `agent` does;
   * without it, the active span's resource is read. */
  resource?: { attributes: Record<string, unknown> };
  log?: (line: string) => void;
  clientId?: string;
}

export class KillSwitch implements Checker {
  constructor(options: KillSwitchOptions);
  readonly signals: SignalBook;
  readonly received: number;
  readonly ignored: Map<string, number>;
  readonly malformed: number;
  readonly rejected: number;
  readonly expired: number;
  start(options?: { timeoutMs?: number }): Promise<this>;
  readonly conversationId: string | null;
  readonly agent: { service: string; name: string | null } | null;
  /** With no trace (none given, no active span) only the scope is checked, and the call is
   * counted in `unguarded` and warned about once through `log`. */
  check(traceId?: string | null, scope?: CheckScope): string | null;
  /** Checks that found no trace to check: tool calls nothing guarded. */
  readonly unguarded: number;
  /** Count a tool call that could not be checked; warn once per `where` (the hooks call it). */
  noteUnguarded(where: string, whatToDo: string): void;
  /** The conversation and agent a check stands for: given, the switch's own, then the active
   * OpenTelemetry baggage (conversation) and the switch's resource, else the active span's
   * (agent). */
  scope(given?: CheckScope): { conversationId: string | null; agent: { service: string; name?: string | null } | null };
  wait(traceId?: string | null, options?: WaitOptions): Promise<string | null>;
  close(): Promise<void>;
}

export function currentTraceId(): string | null;
/** The conversation named in the active OpenTelemetry baggage (gen_ai.conversation.id, session.id). */
export function currentConversationId(): string | null;
/** The agent a resource names: service.name, with gen_ai.agent.name; null without a service.name. */
export function agentOf(resource: { attributes: Record<string, unknown> } | null | undefined): { service: string; name: string | null } | null;
/** The agent the active span's resource names (an SDK span carries its provider's), or null. */
export function currentAgent(): { service: string; name: string | null } | null;
/** 'SERVICE/NAME' or 'SERVICE' as an agent identity. */
export function parseAgent(text: string): { service: string; name: string | null };

export interface HookOptions {
  traceId?: string;
  /** The run's conversation and agent, passed to every check (see CheckScope). */
  conversationId?: string;
  agent?: { service: string; name?: string | null };
  onDowngrade?: (message: string) => void;
  abortController?: AbortController;
}

/** Tool calls a hook found no trace for (no traceId given, no active span): not guarded,
 * warned about once and counted here (and in the KillSwitch's `unguarded`). */
export function guardTools<T extends Record<string, unknown>>(tools: T, checker: Checker, options?: HookOptions): T & { readonly pendingMessages: string[]; readonly unguarded: number };
export function spanguardCallbackHandler(checker: Checker, options?: HookOptions): Promise<object & { pendingMessages: string[]; readonly unguarded: number }>;

export type BadSignalKind =
  | 'empty' | 'too_large' | 'not_utf8' | 'not_json' | 'too_deep' | 'not_object' | 'invalid'
  | 'unsigned' | 'unknown_key' | 'forged' | 'expired' | 'consumer_error' | 'internal';

export class BadSignal extends Error {
  readonly kind: BadSignalKind;
  readonly detail: string;
}

export const MAX_SIGNAL_BYTES: number;
export const MALFORMED_KINDS: ReadonlySet<string>;
export const REJECTED_KINDS: ReadonlySet<string>;
export function keyId(key: string | Uint8Array): string;
export function keyring(keys: string | Uint8Array | Iterable<string | Uint8Array>): Map<string, Uint8Array>;
export function readSignal(value: Uint8Array | null | undefined, keys: Map<string, Uint8Array> | null, now?: Date): KillSignal;
export function sign(record: Record<string, unknown>, key: string | Uint8Array): Record<string, unknown>;
export function verify(record: Record<string, unknown>, keys: Map<string, Uint8Array>): 'valid' | 'unsigned' | 'unknown_key' | 'forged';
export function canonicalJson(value: unknown): string;

/** The span events a kill, pause or downgrade leaves on the active span (stop.js). */
export const STOP_EVENT: 'spanguard.stop';
export const DOWNGRADE_EVENT: 'spanguard.downgrade';
/** The exit status of an agent process the guard stopped. */
export const EXIT_KILLED: 75;
export function stopAttributes(signal: KillSignal): Record<string, string>;
export function recordOnActiveSpan(signal: KillSignal): boolean;
export function findStop(error: unknown): AgentKilled | AgentPaused | null;
export function stopReason(stop: AgentKilled | AgentPaused): Record<string, string>;
/** Run fn; a guard's stop becomes exit(EXIT_KILLED) after one JSON line on stderr. */
export function exitOnStop<T>(
  fn: () => T | Promise<T>,
  options?: { exit?: (code: number) => never; stderr?: { write(text: string): unknown } },
): Promise<T>;
