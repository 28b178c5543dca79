#!/usr/bin/env node
// Example Node.js client of kvserve.v1.GenerationService (@grpc/grpc-js + @grpc/proto-loader).
//
// Streams a two-turn chat session and prints each reply as it is generated, followed by
// one line with the turn's cache figures. The second turn's prompt is the whole session
// transcript, so its cached_tokens is > 0: the server restored the first turn's KV blocks
// (from the device pool, host memory or Redis) instead of recomputing them.
//
//   npm install
//   node index.js --address localhost:50051 [--session ID] [--max-new-tokens N]
//                 [--message TEXT]... [--timeout SECONDS] [--json-schema JSON | --regex PATTERN]
//                 [--tools JSON [--tool-choice auto|required|none|NAME]] [--speculative on|off]
//
// Each --message is one turn (default: two built-in turns), or a session operation:
//   --message /regenerate     the last answer again (temperature 1.0), replacing it (Generate, TURN_MODE_REGENERATE)
//   --message "/edit TEXT"    TEXT replaces the last message, answered anew (TURN_MODE_EDIT)
//   --message /undo           drop the last turn (RewindSession, turns = 1)
//   --message "/fork NAME"    branch into a new session NAME and continue there (ForkSession)
//   --message /warm           restore the session's KV blocks into the server's device pool
//                             ahead of the next turn (WarmSession)
// Any other message starting with "/" is a usage error (a mistyped operation is never sent
// to the model as a turn); start it with "//" to send a message that begins with "/".
// --json-schema / --regex constrain every reply (SamplingParams.response_format): the
// reply is JSON valid against the schema, or text the whole of which matches the pattern.
// --tools JSON (OpenAI's tools list) offers functions to the model, --tool-choice
// auto|required|none|NAME says how it calls them; each call prints one line
//   [turn 1] tool_call get_weather {"city": "Paris"} (id call_...)
// and after a reply that called tools the next --message is every call's result (a "tool"
// message per call, the text as its content) instead of a user message: a tool loop.
// --speculative on|off sets SamplingParams.speculative (default: the server's setting);
// with it each turn's line ends with the drafts verified and accepted and the tokens per step.
// Output, per turn:
//   [turn 1] user: Hello! ...
//   [turn 1] assistant: <streamed text>
//   [turn 1] session=created cached_tokens=0 prompt_tokens=21 cached_tier=none completion_tokens=32 finish_reason=length ...
// and per operation one line, e.g.
//   [undo] session=node-... turns=1 token_count=45 dropped_tokens=40
//   [fork] session=branch from=node-... turns=2 token_count=85 shared_blocks=5/5
//   [warm] session=node-... blocks=5 on_device=0 restored=5 missing=0 over_cap=0
// Exit status: 0 on success, 1 on a failed call (the gRPC status is printed), 2 on bad usage.
'use strict';

const crypto = require('node:crypto');
const path = require('node:path');
const { parseArgs } = require('node:util');

const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const PROTO_ROOT = path.resolve(__dirname, '..', '..', 'proto');
const PROTO_FILE = 'kvserve/v1/generation.proto';
const DEFAULT_MESSAGES = ['Hello! Who are you?', 'Tell me more about that.'];
// Request metadata naming the session: a proxy in front of several replicas hashes on it
// so that every turn reaches the replica holding the session's KV (deploy/haproxy/).
const SESSION_METADATA_KEY = 'x-kvserve-session';

function loadService() {
  // keepCase: fields keep their proto names (session_id, cached_tokens); enums as strings;
  // oneofs: true adds a virtual field naming the member set (response.event = 'delta').
  // google/protobuf/{duration,timestamp}.proto come with protobufjs.
  const definition = protoLoader.loadSync(PROTO_FILE, {
    includeDirs: [PROTO_ROOT],
    keepCase: true,
    longs: Number,
    enums: String,
    defaults: true,
    oneofs: true,
  });
  return grpc.loadPackageDefinition(definition).kvserve.v1.GenerationService;
}

function parseOptions(argv) {
  const { values } = parseArgs({
    args: argv,
    options: {
      address: { type: 'string', default: 'localhost:50051' },
      session: { type: 'string' },
      'max-new-tokens': { type: 'string', default: '32' },
      message: { type: 'string', multiple: true },
      timeout: { type: 'string', default: '60' },
      'json-schema': { type: 'string' },
      regex: { type: 'string' },
      tools: { type: 'string' },
      'tool-choice': { type: 'string' },
      speculative: { type: 'string' },
      help: { type: 'boolean', short: 'h', default: false },
    },
  });
  const maxNewTokens = Number.parseInt(values['max-new-tokens'], 10);
  const timeoutS = Number.parseFloat(values.timeout);
  if (!(maxNewTokens > 0) || !(timeoutS > 0)) {
    throw new Error('--max-new-tokens and --timeout must be positive numbers');
  }
  if (values['json-schema'] !== undefined && values.regex !== undefined) {
    throw new Error('give at most one of --json-schema and --regex');
  }
  const spec = values.speculative;
  if (spec !== undefined && spec !== 'on' && spec !== 'off') throw new Error('--speculative must be on or off');
  let responseFormat = null;
  if (values['json-schema'] !== undefined) responseFormat = { json_schema: values['json-schema'] };
  if (values.regex !== undefined) responseFormat = { regex: values.regex };
  const messages = (values.message && values.message.length ? values.message : DEFAULT_MESSAGES).map(parseMessage);
  let tools = null;
  if (values.tools !== undefined) {
    let list;
    try {
      list = JSON.parse(values.tools);
    } catch (err) {
      throw new Error(`--tools is not JSON: ${err.message}`);
    }
    if (!Array.isArray(list)) throw new Error('--tools must be a JSON list of tools');
    tools = list.map((t) => {
      const fn = t.function || t;
      return { name: fn.name, description: fn.description || '', parameters: fn.parameters ? JSON.stringify(fn.parameters) : '' };
    });
  }
  let toolChoice = null;
  const choice = values['tool-choice'];
  if (choice !== undefined) {
    if (!tools) throw new Error('--tool-choice needs --tools');
    toolChoice = ['auto', 'required', 'none'].includes(choice)
      ? { mode: `TOOL_CHOICE_MODE_${choice.toUpperCase()}` }
      : { mode: 'TOOL_CHOICE_MODE_FUNCTION', function_name: choice };
  }
  return {
    tools,
    toolChoice,
    pendingCalls: [], // the last reply's tool calls: the next message answers them
    help: values.help,
    address: values.address,
    session: values.session || `node-${crypto.randomBytes(6).toString('hex')}`,
    maxNewTokens,
    timeoutS,
    messages,
    responseFormat,
    speculative: spec === undefined ? null : spec === 'on',
  };
}

// One --message: {command, arg} for a session operation, {text} for a turn. A mistyped or
// incomplete operation is a usage error here, before any call (never a turn's text).
const OPERATIONS = { '/regenerate': false, '/undo': false, '/edit': 'TEXT', '/fork': 'NAME', '/warm': false };
function parseMessage(message) {
  if (message.startsWith('//')) return { text: message.slice(1) };
  if (!message.startsWith('/')) return { text: message };
  const [command, ...rest] = message.split(' ');
  const arg = rest.join(' ').trim();
  if (!(command in OPERATIONS)) {
    throw new Error(
      `--message ${JSON.stringify(message)}: unknown operation ${command} (one of ${Object.keys(OPERATIONS).join(', ')}; ` +
        'start a message with // to send one that begins with /)',
    );
  }
  const needs = OPERATIONS[command];
  if (needs && !arg) throw new Error(`--message ${JSON.stringify(message)}: ${command} needs ${needs}`);
  if (!needs && arg) throw new Error(`--message ${JSON.stringify(message)}: ${command} takes no argument`);
  return { command, arg };
}

function deadline(timeoutS) {
  return new Date(Date.now() + timeoutS * 1000);
}

function unary(client, method, request, timeoutS) {
  return new Promise((resolve, reject) => {
    client[method](request, { deadline: deadline(timeoutS) }, (err, response) => (err ? reject(err) : resolve(response)));
  });
}

const tierName = (tier) => tier.replace(/^CACHE_TIER_/, '').toLowerCase();
const finishName = (reason) => reason.replace(/^FINISH_REASON_/, '').toLowerCase();
const seconds = (d) => (d ? Number(d.seconds) + d.nanos / 1e9 : 0);

// One turn: send the new user message in the session, stream the reply to stdout,
// return the turn's figures from the StartEvent and FinalEvent. The turn's header is
// printed when the server accepts it (its StartEvent), so a rejected turn prints only
// its error.
// mode: 'append' (a new turn), 'regenerate' (no message: the last answer again,
// sampled at temperature 1.0) or 'edit' (the message replaces the last one).
async function runTurn(client, opts, turn, message, mode = 'append') {
  const metadata = new grpc.Metadata();
  metadata.set(SESSION_METADATA_KEY, opts.session);
  const request = {
    session_id: opts.session,
    // follow-up turns: NOT_FOUND if the server no longer has the session's history
    require_existing_session: turn > 1 && mode === 'append',
    sampling: { max_new_tokens: opts.maxNewTokens },
    turn_mode: `TURN_MODE_${mode.toUpperCase()}`,
  };
  if (opts.responseFormat) request.sampling.response_format = opts.responseFormat;
  if (opts.speculative !== null) request.sampling.speculative = opts.speculative;
  if (opts.tools) request.tools = opts.tools;
  if (opts.toolChoice) request.tool_choice = opts.toolChoice;
  if (mode === 'regenerate') {
    request.sampling.temperature = 1.0;
  } else if (opts.pendingCalls.length && mode === 'append') {
    // the previous reply called tools: this message is their result
    request.chat = { messages: opts.pendingCalls.map((c) => ({ role: 'tool', tool_call_id: c.id, name: c.name, content: message })) };
  } else {
    request.chat = { messages: [{ role: 'user', content: message }] };
  }
  const call = client.Generate(request, metadata, { deadline: deadline(opts.timeoutS) });
  let start = null;
  let final = null;
  for await (const response of call) {
    if (response.event === 'start') {
      start = response.start;
      const asked = mode === 'regenerate' ? 'regenerate' : `user${mode === 'edit' ? ' (edit)' : ''}: ${message}`;
      process.stdout.write(`[turn ${turn}] ${asked}\n[turn ${turn}] assistant: `);
    } else if (response.event === 'delta') {
      process.stdout.write(response.delta.text);
    } else if (response.event === 'final') {
      final = response.final;
    }
  }
  process.stdout.write('\n');
  if (final) {
    opts.pendingCalls = final.tool_calls || [];
    for (const c of opts.pendingCalls) process.stdout.write(`[turn ${turn}] tool_call ${c.name} ${c.arguments} (id ${c.id})\n`);
  }
  if (!start || !final) throw new Error('stream ended without its start or final event');
  const t = final.timings;
  const figures = {
    session: start.session_created ? 'created' : 'resumed',
    cached_tokens: start.cached_tokens,
    prompt_tokens: start.prompt_tokens,
    cached_tier: tierName(start.cached_tier),
    cached_device: start.cached_by_tier.device,
    cached_host: start.cached_by_tier.host,
    cached_redis: start.cached_by_tier.redis,
    completion_tokens: final.usage.completion_tokens,
    finish_reason: finishName(final.finish_reason),
    ttft_ms: Math.round(seconds(t.time_to_first_token) * 1000),
    restore_ms: Math.round(seconds(t.restore) * 1000),
    prefill_ms: Math.round(seconds(t.prefill) * 1000),
    decode_tokens_per_s: Number(t.decode_tokens_per_second.toFixed(1)),
  };
  if (opts.speculative !== null) {
    // --speculative given: the turn's speculative decoding figures too
    Object.assign(figures, {
      draft_tokens: t.draft_tokens,
      accepted_draft_tokens: t.accepted_draft_tokens,
      tokens_per_step: Number(t.tokens_per_step.toFixed(2)),
    });
  }
  const line = Object.entries(figures).map(([k, v]) => `${k}=${v}`).join(' ');
  process.stdout.write(`[turn ${turn}] ${line}\n`);
  return figures;
}

function sessionMetadata(session) {
  const metadata = new grpc.Metadata();
  metadata.set(SESSION_METADATA_KEY, session);
  return metadata;
}

function unaryInSession(client, method, request, opts) {
  return new Promise((resolve, reject) => {
    client[method](request, sessionMetadata(request.session_id), { deadline: deadline(opts.timeoutS) },
      (err, response) => (err ? reject(err) : resolve(response)));
  });
}

// /undo: drop the last turn; its KV blocks stay cached on the server.
async function undo(client, opts) {
  const { session, dropped_tokens: dropped } = await unaryInSession(
    client, 'RewindSession', { session_id: opts.session, turns: 1 }, opts,
  );
  process.stdout.write(
    `[undo] session=${session.session_id} turns=${session.turns} token_count=${session.token_count} dropped_tokens=${dropped}\n`,
  );
  return session.turns;
}

// /fork NAME: a new session with every turn of this one (no KV copied); continue there.
async function fork(client, opts, name) {
  const { session } = await unaryInSession(
    client, 'ForkSession', { session_id: opts.session, new_session_id: name }, opts,
  );
  process.stdout.write(
    `[fork] session=${session.session_id} from=${opts.session} turns=${session.turns} ` +
      `token_count=${session.token_count} shared_blocks=${session.cached_blocks.device}/${session.full_blocks}\n`,
  );
  opts.session = name;
  return session.turns;
}

// /warm: the server restores the session's blocks into its device pool for the next turn.
async function warm(client, opts) {
  const r = await unaryInSession(client, 'WarmSession', { session_id: opts.session }, opts);
  process.stdout.write(
    `[warm] session=${opts.session} blocks=${r.blocks} on_device=${r.on_device} restored=${r.restored} ` +
      `missing=${r.missing} over_cap=${r.over_cap}\n`,
  );
}

async function main(argv) {
  let opts;
  try {
    opts = parseOptions(argv);
  } catch (err) {
    process.stderr.write(`usage error: ${err.message}\n`);
    return 2;
  }
  if (opts.help) {
    process.stdout.write('node index.js --address HOST:PORT [--session ID] [--max-new-tokens N] [--message TEXT|/regenerate|/edit TEXT|/undo|/fork NAME|/warm]... [--timeout SECONDS] [--json-schema JSON | --regex PATTERN] [--tools JSON [--tool-choice auto|required|none|NAME]] [--speculative on|off]\n' +
        '(a --message starting with / other than these is a usage error; start it with // to send a message that begins with /)\n');
    return 0;
  }
  const GenerationService = loadService();
  const client = new GenerationService(opts.address, grpc.credentials.createInsecure());
  try {
    const { model } = await unary(client, 'GetModelInfo', {}, opts.timeoutS);
    process.stdout.write(
      `session ${opts.session} on ${opts.address}: ${model.architecture} (${model.device}, ${model.dtype}, ` +
        `block size ${model.block_size}, tiers ${model.tiers.map(tierName).join('/')})\n`,
    );
    let turns = 0; // completed turns of the current session
    for (const { command, arg, text } of opts.messages) {
      if (command === '/regenerate') {
        await runTurn(client, opts, turns, null, 'regenerate');
      } else if (command === '/edit') {
        await runTurn(client, opts, turns, arg, 'edit');
      } else if (command === '/undo') {
        turns = await undo(client, opts);
      } else if (command === '/fork') {
        turns = await fork(client, opts, arg);
      } else if (command === '/warm') {
        await warm(client, opts);
      } else {
        turns += 1;
        await runTurn(client, opts, turns, text);
      }
    }
    return 0;
  } catch (err) {
    const code = err.code !== undefined ? `${grpc.status[err.code]}: ` : '';
    process.stderr.write(`\nerror: ${code}${err.details || err.message}\n`);
    return 1;
  } finally {
    client.close();
  }
}

main(process.argv.slice(2)).then((status) => {
  process.exitCode = status;
});
