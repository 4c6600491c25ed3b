"""When each frame group of a video decode reaches the client: the whole-clip MP4 answer against
the uint8 `.npy` one, on one server, interleaved. Both routes run the same decode steps; what an MP4
answer adds is the encoder. This says whether that addition is spread over the clip (the encoder
behind the decode, its lag growing group by group) or sits at the end (the last groups' encodes
after the decode ends), which a time to the last byte alone cannot tell.

    python benchmarks/analysis/video_timeline.py                                    # tiny-wan-vae, numpy
    python benchmarks/analysis/video_timeline.py --models wan=wan2.1-vae --backend cuda --shape 21x60x104

A group is counted as arrived when its last byte has: for `.npy`, at its offset in the file (the
header, then 1 frame, then `temporal_factor` frames a group); for MP4, when the group's fragment
(moof + mdat) is whole. Prints each group's arrival (median over the reps, seconds from sending)
for both, the MP4's lag, and the gap between groups."""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import httpx
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "service"), str(HERE.parents[1])]
from benchmarks.machine import describe_machine  # noqa: E402
from server_process import ServerProcess  # noqa: E402
from streaming import NPY, npy  # noqa: E402


def _arrivals(url: str, body: bytes, params: dict, ends) -> list[float]:
    """Seconds from sending to the end of each group, by `ends(received_so_far, bytes) -> groups whole`."""
    t0 = time.perf_counter()
    times: list[float] = []
    with httpx.stream("POST", url, content=body, headers=NPY, params=params, timeout=3600) as r:
        if r.status_code != 200:
            raise SystemExit(f"{params} answered {r.status_code}: {r.read()[:300]!r}")
        got = bytearray()
        for chunk in r.iter_raw():
            got += chunk
            whole = ends(got)
            now = time.perf_counter() - t0
            times.extend([now] * (whole - len(times)))
    return times


def npy_groups(frame_bytes: int, group_frames: int):
    """ends() for a uint8 .npy clip: its header, then a first group of one frame, then groups of `group_frames`."""
    def ends(got: bytearray) -> int:
        if len(got) < 10:
            return 0
        head = 10 + int.from_bytes(got[8:10], "little")
        frames = max(len(got) - head, 0) // frame_bytes
        return 0 if frames < 1 else 1 + (frames - 1) // group_frames
    return ends


def mp4_groups():
    """ends() for a fragmented MP4: the number of whole mdat boxes (a fragment's last box)."""
    state = {"at": 0, "mdats": 0}

    def ends(got: bytearray) -> int:
        at = state["at"]
        while at + 8 <= len(got):
            size = int.from_bytes(got[at:at + 4], "big")
            if size == 1:
                if at + 16 > len(got):
                    break
                size = int.from_bytes(got[at + 8:at + 16], "big")
            if at + size > len(got):
                break
            if got[at + 4:at + 8] == b"mdat":
                state["mdats"] += 1
            at += size
        state["at"] = at
        return state["mdats"]
    return ends


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="wan=tiny-wan-vae")
    ap.add_argument("--backend", default="numpy")
    ap.add_argument("--model", default="wan")
    ap.add_argument("--shape", default="5x16x16", help="latent TxHxW")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--setting", action="append", default=[], metavar="KEY=VALUE",
                    help="another setting of the started server, repeatable (e.g. mp4_encoders=3)")
    args = ap.parse_args()
    extra = dict(pair.lower().split("=", 1) for pair in args.setting)
    srv = ServerProcess(models=args.models, backend=args.backend, max_frames=100000, request_timeout_s=3600, **extra)
    try:
        base = f"{srv.url}/v1/models/{args.model}"
        card = httpx.get(base, timeout=30).json()
        t, h, w = (int(v) for v in args.shape.split("x"))
        lat = np.random.default_rng(0).standard_normal((1, card["latent_channels"], t, h, w)).astype(np.float32)
        body = npy(lat)
        print(f"machine: {describe_machine()}")
        print(f"server: {card['preset']} on {card['backend']} {card['dtype']}; latents {args.shape}; "
              f"median of {args.reps} after two warm-ups, the routes interleaved" + "".join(f"; {p}" for p in args.setting))
        scale = int(card.get("spatial_factor", 8))
        frame_bytes = (h * scale) * (w * scale) * 3
        group_frames = int(card.get("temporal_factor", 4))
        runs = {"mp4": [], "npy uint8": []}
        for rep in range(args.reps + 2):
            mp4 = _arrivals(f"{base}/decode", body, {"format": "mp4"}, mp4_groups())
            u8 = _arrivals(f"{base}/decode", body, {"format": "npy", "dtype": "uint8"},
                           npy_groups(frame_bytes, group_frames))
            if rep >= 2:
                runs["mp4"].append(mp4), runs["npy uint8"].append(u8)
        groups = min(len(r) for rs in runs.values() for r in rs)
        med = {k: [statistics.median(r[g] for r in rs) for g in range(groups)] for k, rs in runs.items()}
        print(f"{'group':>5s} {'npy uint8 s':>11s} {'mp4 s':>8s} {'mp4 lag ms':>10s} {'npy gap ms':>10s} {'mp4 gap ms':>10s}")
        for g in range(groups):
            a, b = med["npy uint8"][g], med["mp4"][g]
            ga = 1e3 * (a - med["npy uint8"][g - 1]) if g else 0.0
            gb = 1e3 * (b - med["mp4"][g - 1]) if g else 0.0
            print(f"{g:5d} {a:11.3f} {b:8.3f} {1e3 * (b - a):10.1f} {ga:10.1f} {gb:10.1f}")
        ends = {k: statistics.median(r[-1] for r in rs) for k, rs in runs.items()}
        print("last byte (median s): " + ", ".join(f"{k} {v:.3f}" for k, v in ends.items()))
    finally:
        srv.stop()


if __name__ == "__main__":
    main()
