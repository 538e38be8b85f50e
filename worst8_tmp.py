"""Probe: 8 concurrent questions on stored 2K contexts (vs_vllm's worst-of-8), with py-spy dumps."""
import asyncio, subprocess, sys, tempfile, threading, time
from pathlib import Path
import httpx
from benchmarks.vs_vllm import gateway_env, stream_chat, context_messages, QUESTIONS
from benchmarks.workload import build_contexts, load_tokenizer

from tests.gateway_process import GatewayProcess

def main(model: Path, extra: dict[str, str]):
    root = Path(tempfile.mkdtemp())
    texts = build_contexts(load_tokenizer("default"), 10, 2048)
    env = {**gateway_env(model, "float32", root / "stored-2k"), **extra}
    with GatewayProcess(env, root / "enc.log") as g:
        for text in texts:
            httpx.post(f"{g.url}/contexts", json={"messages": [{"role": "system", "content": text}]}, timeout=900).raise_for_status()
    for rep in range(2):
        with GatewayProcess(env, root / "g.log") as g:
            async def ask(text):
                async with httpx.AsyncClient() as c:
                    return (await stream_chat(c, g.url, context_messages(text, QUESTIONS[0]), 8))
            asyncio.run(ask(texts[0]))
            alone = asyncio.run(ask(texts[1]))
            dumps = []
            def spy():
                time.sleep(0.6)
                for _ in range(3):
                    dumps.append(subprocess.run(["py-spy", "dump", "--pid", str(g.proc.pid)], capture_output=True, text=True).stdout)
                    time.sleep(0.5)
            t = threading.Thread(target=spy); 
            if rep == 1: t.start()
            async def together():
                return await asyncio.gather(*(ask(x) for x in texts[2:]))
            res = asyncio.run(together())
            if rep == 1: t.join()
            worst = max(r[0] for r in res)
            print(f"alone {alone[0]:.3f} worst {worst:.3f} ratio {worst/alone[0]:.1f}", [round(r[0],2) for r in res], flush=True)

    Path("/tmp/spy.txt").write_text("\n=====\n".join(dumps))

if __name__ == "__main__":
    import json
    from engine.loading import default_cache_dir
    model = Path(sys.argv[1])
    main(model, json.loads(sys.argv[2]) if len(sys.argv) > 2 else {})
