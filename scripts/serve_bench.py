"""``lantern serve`` under load beside ``lantern generate`` offline, in one sitting.

Runs ``lantern generate`` (offline images/s over --images images; one image's time), then starts
``lantern serve`` with the same settings on a free loopback port and, for each count of
concurrent clients, sends --images one-image requests from that many client threads: images/s
and the p50/p95 of the request latency. Prints a Markdown table (BENCHMARKS.md, "Issue 49").

    python scripts/serve_bench.py --batch-size 4 --images 32 -- --method lantern++

Arguments after ``--`` go to both commands (model, method, backend, threads...).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

LANTERN = [sys.executable, "-m", "lantern_rt.cli"]


def offline(args: argparse.Namespace, images: int, classes: int, out: Path) -> dict:
    """``lantern generate``'s stats for ``images`` images over ``classes`` classes."""
    per_class = images // classes
    command = [*LANTERN, "generate", "--class", ",".join(map(str, range(classes))), "-n", str(per_class)]
    command += ["--batch-size", str(args.batch_size), "--streams", "1", "-q", "-o", str(out / "grid.png")]
    command += ["--stats-json", "-", *args.extra]
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    return json.loads(done.stdout)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--images", type=int, default=32, help="images per measurement (at least 8)")
    parser.add_argument("--clients", default="1,4,16", help="concurrent clients, comma-separated")
    parser.add_argument("extra", nargs="*", help="after --: options for both commands")
    args = parser.parse_args()
    if args.images < 8:
        parser.error("--images must be at least 8: the offline run spreads them over 8 classes")
    clients = [int(c) for c in args.clients.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        stats = offline(args, args.images, 8, out)
        offline_rate = stats["num_images"] / (stats["decode_seconds"] + stats["vq_decode_seconds"])
        one = offline(args, 1, 1, out)
        one_image = one["decode_seconds"] + one["vq_decode_seconds"]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        command = [*LANTERN, "serve", "--port", str(port), "--batch-size", str(args.batch_size)]
        command += ["--max-queue-images", str(max(64, 2 * max(clients))), *args.extra]
        server = subprocess.Popen(command, stderr=subprocess.DEVNULL, env=dict(os.environ))
        url = f"http://127.0.0.1:{port}"
        try:
            while True:
                try:
                    if httpx.get(url + "/health/ready", timeout=5).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if server.poll() is not None:
                    sys.exit(f"lantern serve exited with {server.returncode}")
                time.sleep(0.5)
            print("| clients | images/s | vs offline | p50 latency s | p95 latency s | p50 vs one image |")
            print("| ---: | ---: | ---: | ---: | ---: | ---: |")

            def request(i: int) -> float:
                t0 = time.perf_counter()
                response = httpx.post(
                    url + "/v1/images/generations", json={"prompt": str(i % 8), "seed": i}, timeout=600
                )
                response.raise_for_status()
                return time.perf_counter() - t0

            for count in clients:
                t0 = time.perf_counter()
                with ThreadPoolExecutor(count) as pool:
                    latencies = list(pool.map(request, range(args.images)))
                rate = args.images / (time.perf_counter() - t0)
                p50 = statistics.median(latencies)
                print(
                    f"| {count} | {rate:.2f} | {rate / offline_rate:.2f}x | {p50:.3f} | "
                    f"{percentile(latencies, 0.95):.3f} | {p50 / one_image:.2f}x |"
                )
            print(
                f"\noffline (lantern generate, {stats['num_images']} images, batch {args.batch_size}): "
                f"{offline_rate:.2f} images/s; one image: {one_image:.3f} s ({stats['method']}, {stats['backend']})"
            )
        finally:
            server.terminate()
            server.wait(60)


if __name__ == "__main__":
    main()
