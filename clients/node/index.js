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
//                 [--message TEXT]... [--timeout SECONDS]
//
// Each --message is one turn (default: two built-in turns). Output, per turn:
//   [turn 1] user: Hello! ...
//   [turn 1] assistant: <streamed text>
//   [turn 1] session=created cached_tokens=0 prompt_tokens=21 cached_tier=none completion_tokens=32 finish_reason=length ...
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
      help: { type: 'boolean', short: 'h', default: false },
    },
  });
  const maxNewTokens = Number.parseInt(values['max-new-tokens'], 10);
  const timeoutS = Number.parseFloat(values.timeout);
  if (!(maxNewTokens > 0) || !(timeoutS > 0)) {
    throw new Error('--max-new-tokens and --timeout must be positive numbers');
  }
  return {
    help: values.help,
    address: values.address,
    session: values.session || `node-${crypto.randomBytes(6).toString('hex')}`,
    maxNewTokens,
    timeoutS,
    messages: values.message && values.message.length ? values.message : DEFAULT_MESSAGES,
  };
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
async function runTurn(client, opts, turn, message) {
  const metadata = new grpc.Metadata();
  metadata.set(SESSION_METADATA_KEY, opts.session);
  const call = client.Generate(
    {
      session_id: opts.session,
      // follow-up turns: NOT_FOUND if the server no longer has the session's history
      require_existing_session: turn > 1,
      chat: { messages: [{ role: 'user', content: message }] },
      sampling: { max_new_tokens: opts.maxNewTokens },
    },
    metadata,
    { deadline: deadline(opts.timeoutS) },
  );
  let start = null;
  let final = null;
  for await (const response of call) {
    if (response.event === 'start') {
      start = response.start;
      process.stdout.write(`[turn ${turn}] user: ${message}\n[turn ${turn}] assistant: `);
    } else if (response.event === 'delta') {
      process.stdout.write(response.delta.text);
    } else if (response.event === 'final') {
      final = response.final;
    }
  }
  process.stdout.write('\n');
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
  const line = Object.entries(figures).map(([k, v]) => `${k}=${v}`).join(' ');
  process.stdout.write(`[turn ${turn}] ${line}\n`);
  return figures;
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
    process.stdout.write('node index.js --address HOST:PORT [--session ID] [--max-new-tokens N] [--message TEXT]... [--timeout SECONDS]\n');
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
    for (const [i, message] of opts.messages.entries()) {
      await runTurn(client, opts, i + 1, message);
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
