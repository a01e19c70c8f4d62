"""Two `kvcache serve` instances sharing one Redis: instance A reads a document, then instance B answers questions
about it, against instance C, which has no shared tier. Reports B's and C's time to first token, the prompt tokens
each computed, whether their answers are the same, and B / C as ratios.

    python scripts/bench_two_instances.py --json results/two_instances.json [--doc-tokens 2000] [--questions 8]
        [--concurrent]

A redis-server is started on a free port in a temporary directory (Debian's `redis-server`) and stopped after;
the three servers start together on the demo model (or --model), each with --kv-cache-memory 512MiB. Requests
go through the OpenAI API (streaming /v1/completions, greedy) with the `openai` client, one at a time, or with
--concurrent all questions at once (users asking about the same document together); B and C each answer a short
unrelated request first, so that their first question's TTFT is not a cold start's. One at a time, C's own prefix
cache serves its questions after the first, so its mean TTFT is mostly the first question's.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_vs_llama_cpp import ROOT, free_port, stop, wait_ready  # noqa: E402


def metric(url: str, name: str) -> float:
    import httpx
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def ask(client, model: str, prompt: str, max_tokens: int) -> tuple[float, str]:
    """(seconds to the first streamed token, the whole answer) of one greedy completion."""
    t = time.perf_counter()
    first, text = None, []
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True):
        if first is None and chunk.choices and chunk.choices[0].text:
            first = time.perf_counter() - t
        text.extend(c.text for c in chunk.choices)
    return first if first is not None else time.perf_counter() - t, "".join(text)


def document(tokenizer_source: str | None, n_tokens: int) -> str:
    from kvcache.models.loader import read_checkpoint
    tok = read_checkpoint(tokenizer_source).tokenizer
    corpus = open(os.path.join(ROOT, "kvcache", "eval", "data", "stdlib_docstrings.txt")).read()
    ids = tok.encode(corpus)[:n_tokens]
    return tok.decode(ids)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--doc-tokens", type=int, default=2000)
    p.add_argument("--questions", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--concurrent", action="store_true", help="send the questions all at once (default: one by one)")
    p.add_argument("--json", default="results/two_instances.json")
    args = p.parse_args()
    from openai import OpenAI

    redis_exe = shutil.which("redis-server")
    if redis_exe is None:
        raise SystemExit("redis-server is not installed (apt-get install redis-server)")
    tmp = tempfile.mkdtemp(prefix="kvcache-two-")
    rport = free_port()
    redis = subprocess.Popen([redis_exe, "--port", str(rport), "--bind", "127.0.0.1", "--dir", tmp, "--save", "",
                              "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    remote = f"redis://127.0.0.1:{rport}/0"
    procs, urls = {}, {}
    try:
        for name, extra in (("A", ["--kv-remote", remote]), ("B", ["--kv-remote", remote]), ("C", [])):
            port = free_port()
            urls[name] = f"http://127.0.0.1:{port}"
            cmd = [sys.executable, "-m", "kvcache.cli", "serve", "--port", str(port), "--kv-cache-memory", "512MiB",
                   *(["--model", args.model] if args.model else []), *extra]
            procs[name] = subprocess.Popen(cmd, stdout=open(os.path.join(tmp, f"{name}.log"), "w"),
                                           stderr=subprocess.STDOUT, start_new_session=True)
        for name, proc in procs.items():
            wait_ready(urls[name], proc)
        clients = {n: OpenAI(base_url=u + "/v1", api_key="none") for n, u in urls.items()}
        model = clients["A"].models.list().data[0].id
        doc = document(args.model, args.doc_tokens)
        questions = [f"\n\nQuestion {i + 1}: what does the section above say about item {3 * i + 1}? Answer:"
                     for i in range(args.questions)]
        a_ttft, _ = ask(clients["A"], model, doc + "\n\nSummarize the text above:", 1)
        import redis as redis_client
        r = redis_client.Redis.from_url(remote)
        for _ in range(100):  # A writes in the background: wait until its blocks are all in Redis
            before = r.dbsize()
            time.sleep(0.2)
            if r.dbsize() == before and before:
                break
        results = {"doc_tokens": args.doc_tokens, "questions": args.questions, "concurrent": args.concurrent,
                   "A_ttft_s": a_ttft,
                   "redis_blocks": r.dbsize()}
        for name in ("B", "C"):  # warm: a short unrelated request first, so the first question measures the tier
            ask(clients[name], model, "Hello", 1)
        for name in ("B", "C"):
            prompt0, hits0 = metric(urls[name], "kvcache:prompt_tokens_total"), metric(
                urls[name], "kvcache:prefix_cache_hits_total")
            if args.concurrent:
                from concurrent.futures import ThreadPoolExecutor
                with ThreadPoolExecutor(len(questions)) as pool:
                    done = list(pool.map(lambda q: ask(clients[name], model, doc + q, args.max_tokens), questions))
            else:
                done = [ask(clients[name], model, doc + q, args.max_tokens) for q in questions]
            ttfts, answers = [t for t, _ in done], [a for _, a in done]
            prompt = metric(urls[name], "kvcache:prompt_tokens_total") - prompt0
            hits = metric(urls[name], "kvcache:prefix_cache_hits_total") - hits0
            results[name] = {"ttft_s": ttfts, "ttft_mean_s": sum(ttfts) / len(ttfts), "first_ttft_s": ttfts[0],
                             "prompt_tokens": prompt, "prefill_tokens_computed": prompt - hits, "answers": answers,
                             "offload_loaded_blocks": metric(urls[name], "kvcache:kv_offload_loaded_blocks_total")}
        b, c = results["B"], results["C"]
        results["ratios"] = {"ttft_mean_C_over_B": c["ttft_mean_s"] / b["ttft_mean_s"],
                             "first_ttft_C_over_B": c["first_ttft_s"] / b["first_ttft_s"],
                             "prefill_reduction": 1 - b["prefill_tokens_computed"] / c["prefill_tokens_computed"],
                             "same_answers": b["answers"] == c["answers"]}
    finally:
        for proc in procs.values():
            stop(proc)
        redis.terminate()
        redis.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\ndocument {args.doc_tokens} tokens, read by A (TTFT {results['A_ttft_s']:.2f} s; "
          f"{results['redis_blocks']} blocks in Redis); {args.questions} questions to B (Redis shared with A) "
          f"and C (no tier), {'all at once' if args.concurrent else 'one at a time'}")
    head = f"{'instance':<24}{'TTFT mean s':>12}{'first TTFT s':>14}{'prefill tok':>13}{'loaded blocks':>15}"
    print(head + "\n" + "-" * len(head))
    for name, label in (("B", "B: shared Redis tier"), ("C", "C: no tier")):
        v = results[name]
        print(f"{label:<24}{v['ttft_mean_s']:>12.3f}{v['first_ttft_s']:>14.3f}{v['prefill_tokens_computed']:>13,.0f}"
              f"{v['offload_loaded_blocks']:>15,.0f}")
    rt = results["ratios"]
    print(f"\nC / B mean TTFT: {rt['ttft_mean_C_over_B']:.2f}x; first question: {rt['first_ttft_C_over_B']:.2f}x; "
          f"B computed {rt['prefill_reduction']:.0%} fewer prompt tokens; same answers: {rt['same_answers']}")
    from kvcache.bench.report import write_json
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
