"""Speculative decoding on a chat-editing workload against llama.cpp (issues 29, 47): kvserve's
``--speculative off`` and ``ngram`` servers (``ngram`` without a draft pool, ``pool`` with
one: ``--draft-pool-memory``, engine/draft_pool.py) and llama-server without and with its own
n-gram speculation, on the same weights, the same token ids, greedy, over HTTP on loopback.

Two modes (``--mode``, both by default, one after the other on the same servers):
``fresh`` sends a different text each round (the workloads below built from other openings,
``OPENINGS``: nothing a server saw before but what the model likes to write anyway);
``repeated`` sends the same requests every round (a regenerate, an agent step repeating an
earlier one, the same question from many users: the untimed round 0 sent them first, so
a server that keeps drafts across requests, llama.cpp's ``ngram-mod`` or kvserve's pool,
has them).

The servers (each ``--threads`` threads: kvserve's ``--torch-threads``, llama-server's
``-t``) are all started first and then serve one request at a time: never two compute at
once. Every round sends each workload to every server in turn (alternating, so drift on a
shared machine hits them alike); the first round is untimed (warm-up, and kvserve's
token-for-token check through ``logprobs``), the figures are the medians of ``--rounds``
rounds after it.

Workloads (the default model follows no instructions and repeats only what it would write
anyway, so each "edit" is played as the model handed its own greedy text again, changed, and
going on from its start; random weights never repeat their context at all, which is why the
default model is the one measured):

- ``rewrite``: the previous answer rewritten with small changes: the model's greedy paragraph
  (from "The principal") with three words swapped, a blank line, and the paragraph's first
  8 tokens: the reply is the paragraph as the model writes it, its words where the swaps were;
- ``code-fix``: a code block corrected: a code-shaped block (``def principal():`` / ``return
  "...``, the string the model's own greedy text: its tokenizer is English prose, and this is
  text it continues), with two typos, fenced, then "Fixed:" and the block's first line again;
- ``summary``: a document summarized with quotes: a 200-token greedy document (from "I had
  been"), then ``In short, it says: "`` and 8 tokens from the document's middle.

Each request: ``/v1/completions`` with the prompt as token ids, ``temperature`` 0,
``max_tokens`` (default 128), ``ignore_eos``, streamed. Decode tok/s two ways: each server's
own ``timings.predicted_per_second`` (llama.cpp's; kvserve's HTTP front returns the same
object), and the client's: output tokens after the first over the wall time from the first
streamed text to the last chunk. Acceptance: ``timings.draft_n_accepted / draft_n``.
kvserve runs at its default ``--stream-interval`` (20 ms: the tokens made within one interval
go in one chunk, the first at once), llama-server sends a chunk per token; ``--stream-interval
0`` makes kvserve stream per token too.

    python bench/bench_chat_edit.py --llama-bin /work/llama/src/build/bin
    python bench/bench_chat_edit.py --weight-format bf16 ...   # kvserve bf16 weights, GGUF F16
    python bench/bench_chat_edit.py --llama-spec 'ngram-simple' --llama-spec 'ngram-mod:--spec-ngram-mod-n-min 2'
    python bench/bench_chat_edit.py --no-llama --repo /tmp/base   # A/B: another checkout's servers in the same rounds
    python bench/bench_chat_edit.py --no-llama --mode repeated --model ~/.cache/kvserve/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ENV_AT_START = dict(os.environ)  # llama-server runs with this (its own OpenMP setting, untouched)

from kvserve.service import kernels  # noqa: E402  torch-free

kernels.passive_openmp()  # before torch loads (this process builds the workloads; the servers set it themselves)

from tests.fixtures.redis_server import free_port  # noqa: E402
from tests.fixtures.serving import start_server_process  # noqa: E402

EDITS = {" was ": " had been ", " the ": " that ", " not ": " never "}  # the rewrite workload's word swaps
TYPOS = {" was ": " wsa ", " the ": " teh "}  # the code-fix workload's typos
CODE_HEAD = 'def principal():\n    return "The principal'
# each variant's openings: the rewrite's and code-fix's paragraph, the summary's document
OPENINGS = [
    ("The principal", "I had been"), ("The old man", "We had come"), ("In the morning", "She had gone"),
    ("The captain", "He had been"), ("The house", "They had seen"), ("The doctor", "It had been"),
    ("The river", "You have been"), ("The letter", "I have never"), ("The village", "We were all"),
    ("The young lady", "He was not"), ("The garden", "She was very"), ("The king", "There was a"),
]  # fmt: skip
LLAMA_SPEC_DEFAULT = ["ngram-simple", "ngram-simple:--spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m 16"]


# ---- workloads ---------------------------------------------------------------------------


def build_workloads(model_dir: str, tokens: int, variants: int = 1) -> list[dict[str, list[int]]]:
    """The workloads' prompts (token ids), from the model's own greedy text (in this
    process, before any server starts), one set per variant (``OPENINGS``: each variant's
    texts start from other words, so its prompts and replies are new to every server)."""
    import torch

    from kvserve.service.engine.config import EngineConfig
    from kvserve.service.engine.engine import LLMEngine
    from kvserve.service.models.loading import load_model
    from kvserve.service.types import Finished, GenerationRequest, SamplingParams

    torch.set_num_threads(1)
    loaded = load_model(model_dir, dtype="float32", device="cpu")
    tok = loaded.tokenizer
    per_token = loaded.kv_spec(16).bytes_per_token
    eng = LLMEngine(loaded, EngineConfig(model_path="unused", device="cpu", dtype="float32", block_size=16,
                                         kv_cache_memory=256 * 16 * per_token, speculative="off"))  # fmt: skip

    def greedy(prompt: list[int], n: int) -> list[int]:
        eng.add_request(GenerationRequest(f"w{len(prompt)}-{n}-{time.monotonic_ns()}", list(prompt),
                                          SamplingParams(max_new_tokens=n, ignore_eos=True)))  # fmt: skip
        while True:
            for _, ev in eng.step():
                if isinstance(ev, Finished):
                    return list(ev.output_token_ids)

    def swap(text: str, table: dict[str, str]) -> str:
        for a, b in table.items():
            text = text.replace(a, b, 1)
        return text

    room = loaded.config.max_position_embeddings - tokens - 8  # the prompt's room in the context
    para_n = min(tokens + 32, room // 2)

    def build(opening: str, doc_opening: str) -> dict[str, list[int]]:
        p0 = tok.encode(opening)
        para = tok.decode(p0 + greedy(p0, para_n))
        ids = tok.encode(para)
        rewrite = tok.encode(swap(para, EDITS)) + tok.encode_plain("\n\n") + ids[1:9]
        head = CODE_HEAD.replace("The principal", opening)
        c0 = tok.encode(head)
        code = tok.decode(c0 + greedy(c0, para_n)).replace("\n", " ").replace(head.replace("\n", " "), head, 1)
        buggy = swap(code, TYPOS)
        code_fix = (tok.encode("```python\n" + buggy + '"\n```\n\nFixed:\n\n```python\n')
                    + tok.encode_plain(head))  # fmt: skip
        d0 = tok.encode(doc_opening)
        doc = d0 + greedy(d0, min(200, room - 24))
        mid = len(doc) // 2
        summary = doc + tok.encode_plain('\n\nIn short, it says: "') + doc[mid : mid + 8]
        return {"rewrite": rewrite, "code-fix": code_fix, "summary": summary}

    try:
        sets = [build(*OPENINGS[v % len(OPENINGS)]) for v in range(variants)]
    finally:
        eng.close()
    for out in sets:
        for name, prompt in out.items():
            if len(prompt) + tokens > loaded.config.max_position_embeddings:
                raise SystemExit(f"workload {name}: {len(prompt)} prompt tokens + {tokens} do not fit the context")
    return sets


# ---- HTTP --------------------------------------------------------------------------------


def _get(url: str, timeout: float = 5.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read() or b"{}")


def stream_completion(url: str, body: dict, timeout: float = 600.0) -> dict:
    """POST a streamed /v1/completions; the text, the last ``timings`` seen, the
    ``logprobs`` tokens (when asked), and the client's first-text and end times."""
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    text: list[str] = []
    pieces: list[str] = []
    timings: dict = {}
    t_first = None
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            obj = json.loads(data)
            if "error" in obj:
                raise RuntimeError(f"{url}: {obj['error']}")
            for ch in obj.get("choices") or []:
                if ch.get("text"):
                    if t_first is None:
                        t_first = time.perf_counter()
                    text.append(ch["text"])
                lp = ch.get("logprobs")
                if lp and lp.get("tokens"):
                    pieces.extend(lp["tokens"])
            if obj.get("timings"):
                timings = obj["timings"]
    t_end = time.perf_counter()
    return {"text": "".join(text), "timings": timings, "pieces": pieces, "t_first": t_first, "t_end": t_end}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid``, all its threads (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_health(url: str, proc: subprocess.Popen, what: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited ({proc.returncode})")
        try:
            reply = _get(url + "/health")
            if reply.get("status") in ("ok", "SERVING", "serving") or reply == {} or "status" in reply:
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"{what} did not come up")
        time.sleep(0.5)


# ---- servers -----------------------------------------------------------------------------


class Server:
    name: str
    url: str
    proc: subprocess.Popen

    def body(self, prompt: list[int], tokens: int) -> dict:
        return {"prompt": prompt, "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True}

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class Kvserve(Server):
    def __init__(self, model_dir: str, spec: str, threads: int, weight_format: str, max_draft: int,
                 stream_interval: str = "", repo: str = "", pool: str = "0") -> None:  # fmt: skip
        self.name = f"{'base' if repo else 'kvserve'} {spec if pool == '0' or repo else 'pool'}"
        self.spec = spec
        port = free_port()
        flags = ["--model", model_dir, "--device", "cpu", "--dtype", "float32", "--weight-format", weight_format,
                 "--host", "127.0.0.1", "--port", "0", "--http-port", str(port), "--torch-threads", str(threads),
                 "--speculative", spec, "--spec-max-draft", str(max_draft), "--kv-cache-memory", "256MiB",
                 "--host-cache-memory", "0", "--log-level", "info"]  # fmt: skip
        if stream_interval:
            flags += ["--stream-interval", stream_interval]
        if not repo:  # (another checkout runs with its own default, whether it has a draft pool or not)
            flags += ["--draft-pool-memory", pool]
        self.proc, _, self.log = start_server_process(flags, timeout=300, **({"repo": Path(repo)} if repo else {}))
        self.url = f"http://127.0.0.1:{port}"
        wait_health(self.url, self.proc, self.name)
        self.model = _get(self.url + "/v1/models")["data"][0]["id"]

    def body(self, prompt: list[int], tokens: int) -> dict:
        return {**super().body(prompt, tokens), "model": self.model}


class Llama(Server):
    def __init__(self, binary: Path, gguf: Path, threads: int, ctx: int, spec: str | None, workdir: Path,
                 name: str, args: str = "") -> None:  # fmt: skip
        extra: list[str] = shlex.split(args)
        if spec:
            kind, _, flags = spec.partition(":")
            extra += ["--spec-type", kind, *shlex.split(flags)]
        self.name = name
        port = free_port()
        self.log = open(workdir / f"llama-{port}.log", "w")
        self.proc = subprocess.Popen(
            [str(binary), "-m", str(gguf), "-t", str(threads), "-tb", str(threads), "-c", str(ctx), "-np", "1",
             "--host", "127.0.0.1", "--port", str(port), "--no-webui", *extra],
            stdout=self.log, stderr=subprocess.STDOUT, env=ENV_AT_START,
        )  # fmt: skip
        self.url = f"http://127.0.0.1:{port}"
        wait_health(self.url, self.proc, f"{self.name} (log {self.log.name})")

    def stop(self) -> None:
        super().stop()
        self.log.close()


def convert(model_dir: str, src: Path, outtype: str, workdir: Path) -> Path:
    env = dict(ENV_AT_START)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(src / "gguf-py"), env.get("PYTHONPATH")) if p)
    out = workdir / f"model-{outtype}.gguf"
    conv = subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), model_dir, "--outfile", str(out),
                           "--outtype", outtype], env=env, capture_output=True, text=True)  # fmt: skip
    if conv.returncode != 0:
        raise SystemExit(f"convert_hf_to_gguf.py failed:\n{conv.stderr[-3000:]}")
    return out


# ---- the run -----------------------------------------------------------------------------


def measure(servers: list[Server], works: list[dict[str, list[int]]], tokens: int, rounds: int) -> dict:
    """results[workload][server] = list of per-round dicts (round 0 untimed); round r sends
    ``works[r]``'s prompts."""
    res: dict[str, dict[str, list[dict]]] = {w: {s.name: [] for s in servers} for w in works[0]}
    for rnd in range(rounds + 1):
        for wname, prompt in works[rnd].items():
            order = servers if rnd % 2 == 0 else servers[::-1]  # alternate the order too
            for srv in order:
                body = srv.body(prompt, tokens)
                if rnd == 0 and isinstance(srv, Kvserve):
                    body["logprobs"] = 0  # the tokens, for the token-for-token check
                c0 = cpu_seconds(srv.proc.pid)
                r = stream_completion(srv.url, body)
                r["cpu_s"] = cpu_seconds(srv.proc.pid) - c0
                t = r["timings"]
                n = int(t.get("predicted_n", 0))
                span = (r["t_end"] - r["t_first"]) if r["t_first"] is not None else 0.0
                r["client_tok_s"] = (n - 1) / span if n > 1 and span > 0 else 0.0
                r["server_tok_s"] = float(t.get("predicted_per_second", 0.0))
                r["cpu_ms_tok"] = 1e3 * r["cpu_s"] / n if n else 0.0  # the whole request's, prompt included
                res[wname][srv.name].append(r)
            print(f"  round {rnd} {wname}: " + ", ".join(
                f"{s.name} {res[wname][s.name][-1]['server_tok_s']:.0f}" for s in servers), flush=True)  # fmt: skip
    return res


def med(rs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rs[1:])


def best(rs: list[dict], key: str) -> float:
    return max(r[key] for r in rs[1:])


def report(res: dict, servers: list[Server], work: dict[str, list[int]], tokens: int) -> list[dict]:
    """One row per workload: each ratio as "median (best)" of the servers' timings rates."""
    rows = []
    names = [s.name for s in servers]
    kv_off, kv_on, kv_pool, llama_plain = "kvserve off", "kvserve ngram", "kvserve pool", "llama plain"

    def ratio(r: dict, a: str, b: str) -> str:
        return f"{med(r[a], 'server_tok_s') / med(r[b], 'server_tok_s'):.2f} ({best(r[a], 'server_tok_s') / best(r[b], 'server_tok_s'):.2f})"

    for wname in work:
        r = res[wname]
        row: dict = {"workload": wname}
        for n in names:
            if n.startswith("llama"):
                row[f"kv spec / {n}"] = ratio(r, kv_on, n)
                if kv_pool in names:
                    row[f"kv pool / {n}"] = ratio(r, kv_pool, n)
        row["kv spec / kv plain"] = ratio(r, kv_on, kv_off)
        if kv_pool in names:
            row["kv pool / kv plain"] = ratio(r, kv_pool, kv_off)
            row["kv pool / kv spec"] = ratio(r, kv_pool, kv_on)
        # token for token (round 0's logprobs tokens) and text for text in every round
        for which, name in (("spec", kv_on), ("pool", kv_pool)):
            if name not in names:
                continue
            same_tokens = r[name][0]["pieces"] == r[kv_off][0]["pieces"] and bool(r[name][0]["pieces"])
            same_text = all(a["text"] == b["text"] for a, b in zip(r[name], r[kv_off]))
            row[f"kv {which} == kv plain"] = "yes" if same_tokens and same_text else "NO"
        if llama_plain in names:
            row["llama plain == kv plain (text)"] = "yes" if r[llama_plain][-1]["text"] == r[kv_off][-1]["text"] else "no"
        rows.append(row)
    return rows


def print_tables(mode: str, res: dict, servers: list[Server], work: dict[str, list[int]], args) -> None:
    rows = report(res, servers, work, args.tokens)
    names = [s.name for s in servers]
    print(f"## {mode}: " + ("a different text each round (OPENINGS)" if mode == "fresh" else
                            "the same requests every round (the untimed round 0 sent them first)"))  # fmt: skip
    print("| workload | prompt | server | decode tok/s median (best) | client tok/s | CPU ms/token | acceptance | tokens/step |")
    print("|" + " --- |" * 8)
    for wname in work:
        r = res[wname]
        for n in names:
            t = r[n][-1]["timings"]
            d = int(t.get("draft_n", 0))
            acc = f"{int(t.get('draft_n_accepted', 0)) / d:.2f}" if d else "-"
            tps = f"{t['tokens_per_step']:.2f}" if "tokens_per_step" in t else "-"
            print(f"| {wname} | {len(work[wname])} | {n} | {med(r[n], 'server_tok_s'):.1f} ({best(r[n], 'server_tok_s'):.1f}) "
                  f"| {med(r[n], 'client_tok_s'):.1f} | {med(r[n], 'cpu_ms_tok'):.2f} | {acc} | {tps} |")
    if rows:
        ratio_cols = [c for c in rows[0] if c != "workload"]
        print()
        print(f"{mode}: ratios of the servers' decode tok/s, median (best) of the rounds (kv spec: kvserve ngram "
              "without a draft pool; kv pool: with it)")
        print("| workload | " + " | ".join(ratio_cols) + " |")
        print("|" + " --- |" * (len(ratio_cols) + 1))
        for row in rows:
            print(f"| {row['workload']} | " + " | ".join(str(row[c]) for c in ratio_cols) + " |")
        if args.json:
            for row in rows:
                print(json.dumps({"mode": mode, **row}))
    print()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="model directory or name (default: the packaged default model)")
    ap.add_argument("--tokens", type=int, default=128, help="max_tokens per request")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds (after one untimed)")
    ap.add_argument("--mode", choices=["fresh", "repeated", "both"], default="both",
                    help="fresh: a different text each round; repeated: the same requests every round; both (default)")
    ap.add_argument("--pool-memory", default="64MiB", help="the 'kvserve pool' server's --draft-pool-memory "
                    "(0: no such server); 'kvserve ngram' runs with 0")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--weight-format", default="exact", choices=["exact", "bf16"],
                    help="kvserve's --weight-format; llama.cpp gets GGUF F32 for exact, F16 for bf16")
    ap.add_argument("--max-draft", type=int, default=16, help="kvserve's --spec-max-draft")
    ap.add_argument("--stream-interval", default="", help="kvserve's --stream-interval (default: the server's, 20 ms: "
                    "the tokens of one interval in one chunk); 0: a chunk per token, as llama-server streams")
    ap.add_argument("--llama-bin", default="/work/llama/src/build/bin", help="llama.cpp's bin directory")
    ap.add_argument("--llama-src", default="", help="llama.cpp's source (convert_hf_to_gguf.py); default: above --llama-bin")
    ap.add_argument("--llama-spec", action="append", default=None,
                    help="a llama-server speculation: TYPE[:FLAGS] (repeatable; default: " + "; ".join(LLAMA_SPEC_DEFAULT) + ")")
    ap.add_argument("--llama-poll", type=int, default=None,
                    help="llama-server's --poll for every llama server (0: its threads sleep between ops, not spin; default: its own, 50)")
    ap.add_argument("--no-llama", action="store_true", help="kvserve only")
    ap.add_argument("--repo", default="", help="another checkout (its kernels built): its kvserve off and ngram "
                    "servers too, as 'base off' / 'base ngram', in the same rounds")
    ap.add_argument("--json", action="store_true", help="one JSON line per row after the table")
    args = ap.parse_args()

    from kvserve.service.engine.config import DEFAULT_MODEL_DIR

    model_dir = args.model or str(DEFAULT_MODEL_DIR)
    modes = ["fresh", "repeated"] if args.mode == "both" else [args.mode]
    sets = build_workloads(model_dir, args.tokens, args.rounds + 1 if "fresh" in modes else 1)
    if "fresh" in modes and args.rounds + 1 > len(OPENINGS):
        print(f"# note: {args.rounds + 1} rounds, {len(OPENINGS)} openings: fresh rounds past them repeat earlier texts")
    works = {"fresh": sets, "repeated": [sets[0]] * (args.rounds + 1)}
    workdir = Path(tempfile.mkdtemp(prefix="chatedit-bench-"))
    servers: list[Server] = []
    res: dict[str, dict] = {}
    try:
        kv = (model_dir, args.threads, args.weight_format, args.max_draft, args.stream_interval)
        servers.append(Kvserve(kv[0], "off", *kv[1:]))
        servers.append(Kvserve(kv[0], "ngram", *kv[1:]))
        if args.pool_memory not in ("", "0"):
            servers.append(Kvserve(kv[0], "ngram", *kv[1:], pool=args.pool_memory))
        if args.repo:
            for spec in ("off", "ngram"):
                servers.append(Kvserve(kv[0], spec, *kv[1:], repo=args.repo))
        if not args.no_llama:
            bin_dir = Path(args.llama_bin)
            src = Path(args.llama_src) if args.llama_src else next(
                (d for d in (bin_dir, *bin_dir.parents) if (d / "convert_hf_to_gguf.py").exists()), None)  # fmt: skip
            if src is None or not (bin_dir / "llama-server").exists():
                raise SystemExit(f"need {bin_dir / 'llama-server'} and convert_hf_to_gguf.py (--llama-src)")
            gguf = convert(model_dir, src, "f32" if args.weight_format == "exact" else "f16", workdir)
            ctx = max(len(p) for w in sets for p in w.values()) + args.tokens + 64
            servers.append(Llama(bin_dir / "llama-server", gguf, args.threads, ctx, None, workdir, "llama plain",
                                 "" if args.llama_poll is None else f"--poll {args.llama_poll}"))  # fmt: skip
            for i, spec in enumerate(args.llama_spec or LLAMA_SPEC_DEFAULT):
                print(f"# llama spec{i + 1}: --spec-type {spec.replace(':', ' ', 1)}")
                servers.append(Llama(bin_dir / "llama-server", gguf, args.threads, ctx, spec, workdir,
                                     f"llama spec{i + 1}", "" if args.llama_poll is None else f"--poll {args.llama_poll}"))  # fmt: skip
        load = os.getloadavg()
        for mode in modes:
            print(f"# {mode}", flush=True)
            res[mode] = measure(servers, works[mode], args.tokens, args.rounds)
        load_end = os.getloadavg()
    finally:
        for s in servers:
            s.stop()
    print(f"# threads={args.threads} tokens={args.tokens} rounds={args.rounds} weight_format={args.weight_format} "
          f"max_draft={args.max_draft} pool_memory={args.pool_memory} load average at start {load[0]:.2f}, "
          f"at end {load_end[0]:.2f}")
    print("decode tok/s: the server's timings.predicted_per_second, median (best) of the rounds; client tok/s: "
          "first streamed text to the end, median; CPU ms/token: the server process's user+system CPU over the whole request / tokens; "
          "acceptance: draft_n_accepted / draft_n of the last round")
    for mode in modes:
        print_tables(mode, res[mode], servers, works[mode][0], args)


if __name__ == "__main__":
    main()
