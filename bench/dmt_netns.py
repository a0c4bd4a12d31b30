"""Flat against DMT step time over a real slow inter-host link: two network namespaces, one per host.

    sudo .venv/bin/python bench/dmt_netns.py                     # needs CAP_NET_ADMIN (ip netns, tc)
    sudo .venv/bin/python bench/dmt_netns.py --rates 100mbit --steps 20

Each simulated host is a network namespace running its own ``torchrun --nnodes 2 --node-rank h``;
the two are joined by a veth pair whose both ends are shaped by ``tc tbf`` to the given rate, so
every inter-host byte (rendezvous, gloo's all-to-alls and all-reduces) crosses the slow link while a
host's own ranks talk over its loopback. The namespaces, the link and the qdiscs are created here
and removed at the end. The same synthetic Wukong job is trained flat (table_wise) and as DMT with
compression 1x, 2x, 4x; examples/s is the median of the logged training windows after the first.

Writes runs/bench/dmt_netns.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "runs" / "bench"
NS, VETH, ADDR = ("rsdmt_h0", "rsdmt_h1"), ("rsdmt_v0", "rsdmt_v1"), ("10.77.7.1", "10.77.7.2")
VARIANTS = {
    "flat table_wise": ["distributed.sharding=table_wise"],
    "dmt 1x": ["dmt.tower_module={type: identity}"],
    "dmt 2x": ["dmt.tower_module={type: wukong, compression: 2}"],
    "dmt 4x": ["dmt.tower_module={type: wukong, compression: 4}"],
}


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True)


def make_link(rate: str) -> None:
    for ns in NS:
        sh("ip", "netns", "add", ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
    sh("ip", "link", "add", VETH[0], "type", "veth", "peer", "name", VETH[1])
    for ns, veth, addr in zip(NS, VETH, ADDR, strict=True):
        sh("ip", "link", "set", veth, "netns", ns)
        sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", veth)
        sh("ip", "-n", ns, "link", "set", veth, "up")
        sh(
            "tc",
            "-n",
            ns,
            "qdisc",
            "add",
            "dev",
            veth,
            "root",
            "tbf",
            "rate",
            rate,
            "burst",
            "256kb",
            "latency",
            "100ms",
        )


def remove_link() -> None:
    for ns in NS:  # deleting a namespace deletes its end of the veth pair, and with it the other end
        subprocess.run(["ip", "netns", "delete", ns], stderr=subprocess.DEVNULL)


def train(overrides: list[str], run_dir: Path, local: int, port: int) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = []
    for h, (ns, veth) in enumerate(zip(NS, VETH, strict=True)):
        cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
               "--node-rank", str(h), "--nproc-per-node", str(local), "--master-addr", ADDR[0],
               "--master-port", str(port), "-m", "recscale.cli", "train", str(REPO / "configs" / "demo.yaml"),
               *overrides, "--out", str(run_dir)]  # fmt: skip
        procs.append(subprocess.Popen(cmd, env=dict(env, GLOO_SOCKET_IFNAME=veth), stdout=subprocess.DEVNULL))
    if any(p.wait() for p in procs):
        raise SystemExit(f"a host failed training {overrides}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["split"] == "train"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rates", nargs="+", default=["100mbit", "1gbit"], help="tc rates of the inter-host link")
    p.add_argument("--ranks-per-host", type=int, default=1)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=2048, help="global batch")
    args = p.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench/dmt_netns.py needs root (CAP_NET_ADMIN) for ip netns and tc")
    common = [
        f"data.synthetic.rows.train={args.batch * (args.steps + 1)}", "data.synthetic.rows.valid=256",
        "data.synthetic.rows.test=256", "data.synthetic.num_sparse=16", "data.synthetic.num_multi=0",
        "data.synthetic.vocab_sizes=10000", "data.num_workers=0", f"train.batch_size={args.batch}",
        f"train.max_steps={args.steps}", "train.log_every=5", "train.progress=false", "train.early_stopping=null",
        "model.embedding.dim=32", "model.num_layers=1", "model.fmb_mlp=[64]", "model.final_mlp=[64]",
    ]  # fmt: skip
    OUT.mkdir(parents=True, exist_ok=True)
    results = []
    port = 29611
    with tempfile.TemporaryDirectory(prefix="recscale-netns-") as tmp:
        for rate in args.rates:
            remove_link()
            make_link(rate)
            try:
                for name, overrides in VARIANTS.items():
                    port += 1
                    records = train(
                        [*common, *overrides], Path(tmp) / f"{rate}_{len(results)}", args.ranks_per_host, port
                    )
                    rates = [r["examples_per_s"] for r in records[1:]]
                    results.append({
                        "link": rate, "variant": name, "ranks_per_host": args.ranks_per_host,
                        "examples_per_s": round(statistics.median(rates), 1),
                        "step_ms": round(args.batch / statistics.median(rates) * 1e3, 1),
                        "inter_bytes_per_step": records[-1]["comm_inter_bytes"],
                        "intra_bytes_per_step": records[-1]["comm_intra_bytes"],
                    })  # fmt: skip
                    print(json.dumps(results[-1]), flush=True)
            finally:
                remove_link()
    (OUT / "dmt_netns.json").write_text(json.dumps(results, indent=2))
    print("\n| link | variant | inter bytes/step | step ms | examples/s |\n|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['link']} | {r['variant']} | {r['inter_bytes_per_step']:,} | {r['step_ms']} | {r['examples_per_s']:,.0f} |"
        )


if __name__ == "__main__":
    main()
