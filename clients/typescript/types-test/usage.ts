// Compiled by `npm run typecheck` against src/index.d.ts, never run: each line uses the API the
// way the README and the tests do, so a declaration that drifts from it fails the build. The
// `@ts-expect-error` lines are misuses that must stay errors (a declaration widened to `any`
// would let them through, and tsc then fails on the unused directive).
import {
  AgentKilled,
  AgentPaused,
  BadSignal,
  DEFAULT_MAX_TRACES,
  EXIT_KILLED,
  KillSwitch,
  SignalBook,
  STOP_EVENT,
  canonicalJson,
  exitOnStop,
  findStop,
  guardTools,
  keyring,
  parseAgent,
  readSignal,
  securityFromEnv,
  sign,
  spanguardCallbackHandler,
  verify,
  type Checker,
  type KillSignal,
} from '@spanguard/killswitch';

export async function usage(): Promise<void> {
  const killswitch = new KillSwitch({
    brokers: ['localhost:9092'],
    signingKey: 'key',
    security: securityFromEnv(process.env),
    agent: 'support-bot/triage',
  });
  const started: KillSwitch = await killswitch.start({ timeoutMs: 5_000 });
  const decision: string | null = started.check('0af7651916cd43dd8448eb211c80319c');
  const waited: string | null = await killswitch.wait(null, { timeoutMs: 1_000 });
  const unguarded: number = killswitch.unguarded;
  const ignored: Map<string, number> = killswitch.ignored;
  await killswitch.close();

  const book = new SignalBook(DEFAULT_MAX_TRACES, { clock: () => new Date() });
  const keys = keyring(['key', new Uint8Array([1, 2, 3])]);
  const signal: KillSignal = readSignal(new TextEncoder().encode('{}'), keys, new Date());
  const fresh: boolean = book.deliver(signal);
  const kind: 'kill' | 'downgrade' | 'release' | 'pause' = signal.kind;
  const checker: Checker = book;
  checker.check(signal.traceId, { conversationId: signal.conversationId, agent: signal.agent });

  const signed = sign({ trace_id: signal.traceId }, 'key');
  const verdict: 'valid' | 'unsigned' | 'unknown_key' | 'forged' = verify(signed, keys);
  const text: string = canonicalJson(signed);

  const tools = guardTools({ search: async (query: string) => query }, killswitch, {
    onDowngrade: (message: string) => void message,
  });
  const found: string = await tools.search('q');
  const pending: string[] = tools.pendingMessages;
  const handler = await spanguardCallbackHandler(book, { agent: parseAgent('svc/name') });
  void handler.pendingMessages;

  try {
    await exitOnStop(async () => 42);
  } catch (error) {
    const stop = findStop(error);
    if (stop instanceof AgentKilled) {
      const rule: string = stop.rule;
      void rule;
    } else if (stop instanceof AgentPaused) {
      const until: string = stop.until;
      void until;
    } else if (error instanceof BadSignal) {
      const why: string = error.kind;
      void why;
    }
  }
  const exitStatus: 75 = EXIT_KILLED;
  const event: 'spanguard.stop' = STOP_EVENT;
  void [decision, waited, unguarded, ignored, fresh, kind, verdict, text, found, pending];
  void [exitStatus, event];

  // @ts-expect-error: brokers is required
  new KillSwitch({ topic: 'spanguard.kill-signals' });
  // @ts-expect-error: a signal's kind is one of four
  const wrong: KillSignal['kind'] = 'stop';
  // @ts-expect-error: check() answers a decision or null, never a boolean
  const asBoolean: boolean = book.check('0af7651916cd43dd8448eb211c80319c');
  void [wrong, asBoolean];
}
