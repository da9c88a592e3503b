"""Time to first token of each turn of one conversation, through the EngineService the chat app
uses: with the prefix cache, turn N+1 prefills only its new message, so TTFT stays flat while
the history grows. Run with --no-prefix-cache to see the difference.

    python scripts/chat_ttft.py                 # the embedded SmolLM2-135M-Instruct
    python scripts/chat_ttft.py --model DIR --turns 5 --max-tokens 64
"""

from __future__ import annotations

import argparse
import statistics
import time

QUESTIONS = [
    "What is the capital of France?",
    "Tell me three facts about that city.",
    "Which river runs through it?",
    "Name a famous museum there and what it holds.",
    "Summarise our conversation in one sentence.",
    "What language do people speak there?",
    "Give me one word that describes it.",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1, help="conversations to run; medians are printed")
    ap.add_argument("--no-prefix-cache", action="store_true")
    ap.add_argument("--device", default=None)
    args = ap.parse_args()

    from localgen.api import LLM
    from localgen.conversation import Conversation
    from localgen.runtime.request import SamplingParams
    from localgen.service import EngineService

    t = time.perf_counter()
    llm = LLM.load(args.model, device=args.device, kv_cache_memory=256 << 20,
                   enable_prefix_caching=not args.no_prefix_cache)
    print(f"loaded {llm.model_name} on {llm.device} in {time.perf_counter() - t:.1f} s; "
          f"prefix cache {'off' if args.no_prefix_cache else 'on'}")
    rows: dict[int, list[tuple[int, int, float, float]]] = {}
    with EngineService(llm) as svc:
        svc.wait_ready()
        # warm-up (first-call overheads are not the history's fault)
        svc.chat([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0, max_tokens=4)).result()
        for rep in range(args.repeats):
            conv = Conversation(system="You are a helpful assistant.",
                                sampling=SamplingParams(temperature=0.0, max_tokens=args.max_tokens))
            if rep:  # a fresh conversation must not hit the previous one's cache beyond the system prompt
                conv.system += f" (run {rep})"
            for i in range(args.turns):
                stream = svc.submit(conv.ask(QUESTIONS[i % len(QUESTIONS)]))
                out = stream.result()
                conv.record_answer(out, ttft_s=stream.ttft)
                prefill_ms = svc.call(lambda llm: llm.metrics.ttft_seconds[-1]).get() * 1000
                rows.setdefault(i + 1, []).append((out.prompt_tokens, out.cached_prompt_tokens,
                                                   stream.ttft * 1000, prefill_ms))
    print(f"{'turn':>4} {'prompt tok':>10} {'reused':>7} {'TTFT ms':>8} {'engine TTFT ms':>15}")
    for turn, vals in rows.items():
        p, c = vals[-1][0], vals[-1][1]
        ttft = statistics.median(v[2] for v in vals)
        eng = statistics.median(v[3] for v in vals)
        print(f"{turn:>4} {p:>10} {c:>7} {ttft:>8.1f} {eng:>15.1f}")
    first, last = rows[1], rows[max(rows)]
    print(f"turn 1 vs turn {max(rows)}: TTFT {statistics.median(v[2] for v in first):.1f} ms vs "
          f"{statistics.median(v[2] for v in last):.1f} ms "
          f"(prompt {first[-1][0]} vs {last[-1][0]} tokens, {last[-1][1]} reused)")


if __name__ == "__main__":
    main()
