"""GPU smoke test: build tiny bundles and serve them in every mesh a 2-GPU node allows, each row's clip checked
against the eager single-GPU tiny clip. The GPU test CI cannot run; run it before submitting anything that touches
media/, pipeline/, jobs/, run/, engines/, build/ or parallel/.

    python scripts/gpu_smoke.py --json bench/results/gpu_smoke_h200x2.json

Rows (each a real `h3trt` process, as a user runs it):
  eager sp=2 | bf16 bundle sp=2 | bf16 sp=1 bundle, 2 replicas over a batch | fp8 + --fp8-attention bundle sp=2 |
  eager cfg=2 with guidance | torchrun --nproc-per-node 2 serving the sp=2 bundle | the sp=1 bundle on the second
  GPU alone (--device cuda:1, and CUDA_VISIBLE_DEVICES=1) | `h3trt serve` with 2 replica groups, and with one sp=2
  group (two jobs through the API, downloaded)
plus the 1-GPU rows they rest on (sp=1 bundle on GPU 0, torchrun with one rank, `h3trt serve` of the sp=1 bundle), an
sp=1 bundle built with --sparse-attention serving its default (checked against the eager clip with the same sparse
flags) and a request's --sparse-attention 0 (checked against the dense eager clip), a bundle built with --lora-slots
serving a batch whose one request names an adapter (`--adapter style=FILE`; checked against the eager clip with the
same adapter, and far from the clip without it) and whose other names none (checked against the plain eager clip),
the same batch on a bundle built with both --sparse-attention and --lora-slots (the adapter on sparse evaluations,
through the halves' twins: checked against the eager clips with the same adapter and sparse flags, and its records
against the sparse evaluations expected),
and a bundle baked for two schedules (--steps 6,4) serving both (each against the eager clip of its schedule).

The check: decoded frames (PSNR) and audio (SNR) of each row's MP4 against the eager clip of the same request. The
tiny model has random weights, so the clip is noise and x264 re-encodes it lossily; a row passes when it is close
to the reference (PSNR >= --min-psnr) AND far closer than a clip of another seed is (the control), so the check
tells a right clip from a wrong one. Rows needing more GPUs than visible are reported NOT RUN and fail the script:
a partial matrix is never a pass.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

STEPS = 6
# The sparse rows' settings: sparse from the third evaluation on, at the tiny model's short sequence.
SPARSE = ["--sparse-attention", "0.75", "--sparse-dense-steps", "2", "--sparse-min-seq", "1"]
PROMPT = "a red fox runs through fresh snow, wind howling"
SEED, OTHER_SEED = 5, 6
SHORT_STEPS = 4  # the two-schedule bundle's second schedule (--steps 6,4)
SPARSE_BUNDLES = ("s1", "s8")  # bf16 with the build's kernel (FA4 on a GPU), fp8 with the FP8 sparse kernel
# The adapter row's --adapter style=FILE:SCALE: strong enough to move the tiny clip far (20.6 dB from the plain one
# on the CPU; at 0.7 it was 29.3 dB, too close to tell from x264's own noise).
ADAPTER_SCALE = 3.0


LOG_LOCK = threading.Lock()


def without_fa4(env: dict) -> dict | None:
    """The environment with FlashAttention-4's carry (a PYTHONPATH entry naming fa4) taken off the path; None where
    there is none to take off (the row then runs in the plain environment)."""
    parts = env.get("PYTHONPATH", "").split(os.pathsep)
    kept = [part for part in parts if "fa4" not in part]
    return {"PYTHONPATH": os.pathsep.join(kept)} if len(kept) < len(parts) else None


def sh(cmd: list[str], env: dict, log, timeout: int = 600) -> tuple[int, str]:
    start = time.monotonic()
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        rc, text = out.returncode, out.stdout + out.stderr
    except subprocess.TimeoutExpired as e:
        rc, text = 124, f"timed out after {timeout} s\n{e.stdout or ''}{e.stderr or ''}"
    with LOG_LOCK:  # the bundles build side by side: one command's record at a time
        log.write(f"$ {' '.join(cmd)}\n[rc {rc}, {time.monotonic() - start:.1f} s]\n{text}\n")
        log.flush()
    return rc, text


def decode(path: Path) -> tuple[np.ndarray, np.ndarray]:
    import av

    with av.open(str(path)) as f:
        frames = np.stack([fr.to_ndarray(format="rgb24") for fr in f.decode(video=0)]).astype(np.float64)
    with av.open(str(path)) as f:
        audio = np.concatenate([fr.to_ndarray().reshape(-1) for fr in f.decode(audio=0)]).astype(np.float64)
    return frames, audio


def serve_clips(h3: list[str], bundle: Path, flags: list[str], out: Path, env: dict, log) -> tuple[int, str]:
    """`h3trt serve --engine BUNDLE` on a free port: the reference request and the other-seed one POSTed together,
    polled to the end, downloaded to OUT/one.mp4 and OUT/two.mp4; SIGTERM, and the drain's exit status."""
    import signal
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    out.mkdir(parents=True, exist_ok=True)
    cmd = h3 + ["serve", "--engine", str(bundle), "--port", str(port), "--data-dir", str(out / "data")] + flags
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    start = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)

    def call(method: str, path: str, body: dict | None = None):
        request = urllib.request.Request(url + path, method=method, data=json.dumps(body).encode() if body else None,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            data = response.read()
        return data if "/content" in path else json.loads(data)

    try:
        while True:
            if proc.poll() is not None:
                return proc.returncode or 1, f"h3trt serve exited {proc.returncode} before it was ready"
            if time.monotonic() - start > 300:
                return 124, "not ready within 300 s"
            try:
                if call("GET", "/ready")["ready"]:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        ids = {name: call("POST", "/v1/videos", {"prompt": PROMPT, "seed": seed, "steps": STEPS})["id"]
               for name, seed in (("one", SEED), ("two", OTHER_SEED))}
        for name, job_id in ids.items():
            while (job := call("GET", f"/v1/videos/{job_id}"))["status"] in ("queued", "in_progress"):
                if time.monotonic() - start > 540:
                    return 124, f"{name} still {job['status']} after 540 s"
                time.sleep(0.5)
            if job["status"] != "completed":
                return 1, f"job {name}: {job['status']}: {job.get('error')}"
            (out / f"{name}.mp4").write_bytes(call("GET", f"/v1/videos/{job_id}/content"))
        return 0, f"served {len(ids)} jobs in {time.monotonic() - start:.1f} s (start included)"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = "killed"
        log.write(f"[serve exit {code}, {time.monotonic() - start:.1f} s]\n")
        log.flush()


def write_adapter(path: Path) -> Path:
    """A random LoRA over every main-block linear of the tiny model (rank 4, 2 on AdaLN), sized to move each output
    as much as its base weight does, so that a clip served without it is far from one served with it."""
    import torch
    from safetensors.torch import save_file

    from h3trt.adapters.slots import BLOCK_TARGETS
    from h3trt.models.config import H3Config
    from h3trt.models.dit import build_dit

    cfg = H3Config.tiny()
    shapes = {k.removesuffix(".weight"): v.shape for k, v in build_dit(cfg, torch.float32, "meta").state_dict().items()}
    g, tensors = torch.Generator().manual_seed(11), {}
    for i in range(cfg.num_layers):
        for local in BLOCK_TARGETS:
            name, r = f"blocks.{i}.{local}", 2 if local.startswith("adaln") else 4
            rows, cols = shapes[name]
            tensors[f"{name}.lora_A.weight"] = torch.randn(r, cols, generator=g) / cols ** 0.5
            tensors[f"{name}.lora_B.weight"] = torch.randn(rows, r, generator=g) / r ** 0.5
    save_file(tensors, str(path))
    return path


def compare(got: Path, want: Path) -> dict:
    gv, ga = decode(got)
    wv, wa = decode(want)
    if gv.shape != wv.shape:
        return {"psnr_db": float("-inf"), "audio_snr_db": float("-inf"), "why": f"frames {gv.shape} vs {wv.shape}"}
    mse = float(np.mean((gv - wv) ** 2))
    psnr = float("inf") if mse == 0 else 10 * np.log10(255.0 ** 2 / mse)
    n = min(len(ga), len(wa))
    noise = float(np.sum((ga[:n] - wa[:n]) ** 2))
    snr = float("inf") if noise == 0 else 10 * np.log10(float(np.sum(wa[:n] ** 2)) / noise)
    return {"psnr_db": round(psnr, 2), "audio_snr_db": round(snr, 2)}


def judge(want: list[tuple[Path, Path]], control: dict, args, bundle: str | None, flags: list[str], out: Path,
          row_dir: Path, styled_ref: Path, ref: Path) -> dict:
    """A finished row's verdict: every clip close to its eager reference (PSNR >= --min-psnr and --margin above the
    control), and what its records must say on top of that."""
    checks = [compare(got, ref_clip) for got, ref_clip in want]
    worst = min(c["psnr_db"] for c in checks)
    ok = worst >= args.min_psnr and worst >= control["psnr_db"] + args.margin
    row = {"status": "PASS" if ok else "FAIL", "psnr_db": worst, "audio_snr_db": min(c["audio_snr_db"] for c in checks)}
    if not ok:
        row["why"] = f"PSNR {worst} dB vs eager (need >= {args.min_psnr} and control + {args.margin})"
    if bundle in ("l1", "sl1"):  # sl1: styled_ref is the eager sparse batch, its plain clip the plain reference
        row.update(adapter_checks(row_dir, styled_ref, styled_ref / "plain.mp4" if bundle == "sl1" else ref,
                                  args.margin))
    if bundle == "sl1":  # both lines ran sparse from the third evaluation on, the adapter or not
        for line in ("styled", "plain"):
            ran = json.loads((row_dir / f"{line}.json").read_text()).get("sparse_attention", {})
            if ran.get("sparse_evaluations") != list(range(2, STEPS - 1)):
                row.update(status="FAIL", why=f"{line}: sparse evaluations {ran.get('sparse_evaluations')}, "
                                              f"expected {list(range(2, STEPS - 1))}")
    if bundle == "t1":
        steps = json.loads(out.with_suffix(".json").read_text()).get("steps")
        expected = SHORT_STEPS if "--steps" in flags else STEPS
        if steps != expected:
            row.update(status="FAIL", why=f"the clip ran {steps} steps, expected {expected}")
    if bundle in SPARSE_BUNDLES:
        # The tiny model's sparse and dense clips are close (CPU dry run: 34.5 dB apart, above --min-psnr), so PSNR
        # alone cannot tell a sparse row that silently ran dense: its record must say which evaluations ran sparse
        # (none for the 0 request).
        sparse = json.loads(out.with_suffix(".json").read_text()).get("sparse_attention", {})
        ran = sparse.get("sparse_evaluations", [])
        expected = [] if "--sparse-attention" in flags else list(range(2, STEPS - 1))
        row.update(sparse_kernel=sparse.get("kernel"), kept_fraction=sparse.get("kept_fraction"))
        if ran != expected:
            row.update(status="FAIL", why=f"sparse evaluations {ran}, expected {expected}")
        elif bundle == "s8" and sparse.get("kernel") not in ("fp8", "fp8_emulated"):
            row.update(status="FAIL", why=f"the fp8 sparse bundle ran kernel {sparse.get('kernel')!r}, not fp8")
    return row


def adapter_checks(out: Path, styled_ref: Path, plain_ref: Path, margin: float) -> dict:
    """What PSNR against the eager clips cannot tell alone: the records name the adapter on the styled request only,
    and the styled clip is far closer to the eager styled clip than the plain clip is (the adapter changed it)."""
    records = {i: json.loads((out / f"{i}.json").read_text()) for i in ("styled", "plain")}
    named = [(a["name"], a["scale"]) for a in records["styled"].get("adapters") or []]
    control = compare(plain_ref, styled_ref / "styled.mp4")["psnr_db"]
    served = compare(out / "styled.mp4", styled_ref / "styled.mp4")["psnr_db"]
    result = {"adapters": named, "plain_vs_eager_styled_db": control}
    if named != [("style", ADAPTER_SCALE)] or records["plain"].get("adapters"):
        result.update(status="FAIL", why=f"adapters in the records: styled {named}, plain "
                                         f"{records['plain'].get('adapters')}")
    elif served < control + margin:
        result.update(status="FAIL", why=f"the styled clip is {served} dB from the eager styled clip, the plain clip "
                                         f"{control} dB: the adapter did not change it as the eager one")
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, required=True, help="write the table here (a .log is written beside it)")
    ap.add_argument("--work", type=Path, default=None, help="work folder (default: a temporary one, removed)")
    ap.add_argument("--min-psnr", type=float, default=25.0, help="a row's clip vs the eager clip, dB")
    ap.add_argument("--margin", type=float, default=10.0, help="and this many dB above the other-seed control")
    ap.add_argument("--cpu", action="store_true", help="dry-run the script's logic on the CPU: gloo ranks stand in "
                                                         "for 2 GPUs; the GPU-index rows are not run")
    ap.add_argument("--only", default=None, metavar="TEXT[|TEXT...]",
                    help="run only the rows whose name contains one of the |-separated TEXTs (a re-check after a fix, "
                         "or a matrix split over two device calls; the others are reported NOT RUN, so the script "
                         "still fails: a partial matrix is never a pass)")
    args = ap.parse_args()

    import torch

    gpus = 2 if args.cpu else torch.cuda.device_count()
    dev = "cpu" if args.cpu else "cuda"
    work = args.work or Path(tempfile.mkdtemp(prefix="h3trt-smoke-"))
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "XDG_CACHE_HOME": str(work / "cache"), "PYTHONUNBUFFERED": "1"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    h3 = [sys.executable, "-m", "h3trt.cli"]
    log_path = args.json.with_suffix(".log")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    with open(log_path, "w") as log:
        log.write(f"torch {torch.__version__}, {gpus} GPU(s): "
                  f"{'cpu' if args.cpu else [torch.cuda.get_device_name(i) for i in range(gpus)]}\n")

        def run_clip(name: str, extra: list[str], out: Path, needs: int, env_over: dict | None = None,
                     argv: list[str] | None = None, seed: int = SEED) -> tuple[int, str]:
            if gpus < needs or (args.cpu and (env_over or any(a.startswith("cuda:") for a in extra))):
                return -1, f"needs {needs} GPUs, {gpus} visible" if gpus < needs else "a GPU row (--cpu dry run)"
            extra = [dev if a == "cuda" else a for a in extra]
            cmd = (argv or h3) + ["run", "--prompt", PROMPT, "--seed", str(seed), "--steps", str(STEPS), "--quiet",
                                  "--output", str(out)] + extra
            return sh(cmd, {**env, **(env_over or {})}, log)

        # The references: the eager tiny clip on one GPU, and a clip of another seed (the control).
        ref, other = work / "eager.mp4", work / "eager_other_seed.mp4"
        for path, seed in ((ref, SEED), (other, OTHER_SEED)):
            rc, text = run_clip("reference", ["--device", dev], path, 1, seed=seed)
            if rc != 0:
                print(f"the eager reference failed (rc {rc}); see {log_path}\n{text[-2000:]}")
                return 1
        control = compare(other, ref)

        batch = work / "batch.jsonl"
        batch.write_text("".join(json.dumps({"id": i, "task": "t2va", "prompt": PROMPT, "seed": s, "steps": STEPS})
                                 + "\n" for i, s in (("one", SEED), ("two", OTHER_SEED))))
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node"]
        plan = [
            # name, bundle (or None: eager), GPUs, extra flags, env, argv, outputs [(mp4, reference)]
            ("sp=1 bundle, one GPU", "b1", 1, ["--device", "cuda"], None, None),
            ("torchrun 1 rank, sp=1 bundle", "b1", 1, [], None, torchrun + ["1", "-m", "h3trt.cli"]),
            ("sp=1 sparse bundle, its default sparsity", "s1", 1, ["--device", "cuda"], None, None),
            ("sp=1 sparse bundle, request --sparse-attention 0", "s1", 1, ["--device", "cuda", "--sparse-attention",
                                                                          "0"], None, None),
            # The FP8 sparse kernel serves without FA4: the same GPU, FA4's carry taken off the path.
            ("sp=1 fp8 sparse bundle (FP8 kernel), FA4 off the path", "s8", 1, ["--device", "cuda"], without_fa4(env),
             None),
            ("eager sp=2", None, 2, ["--gpus", "2"], None, None),
            ("bf16 bundle sp=2", "b2", 2, ["--gpus", "2"], None, None),
            ("bf16 sp=1 bundle, 2 replicas, batch", "b1", 2, ["--gpus", "2", "--replicas", "2"], None, None),
            ("fp8 + fp8-attention bundle sp=2", "f2", 2, ["--gpus", "2"], None, None),
            ("eager cfg=2, guidance 4", None, 2, ["--gpus", "2", "--cfg", "2", "--sp", "1", "--guidance", "4",
                                                  "--negative-prompt", "blurry"], None, None),
            ("torchrun 2 ranks, sp=2 bundle", "b2", 2, [], None, torchrun + ["2", "-m", "h3trt.cli"]),
            ("sp=1 bundle on the 2nd GPU (--device cuda:1)", "b1", 2, ["--device", "cuda:1"], None, None),
            ("sp=1 bundle on the 2nd GPU (CUDA_VISIBLE_DEVICES=1)", "b1", 2, ["--device", "cuda"],
             {"CUDA_VISIBLE_DEVICES": "1"}, None),
            ("--lora-slots bundle, an adapter named per request", "l1", 1, ["--device", "cuda"], None, None),
            ("--sparse-attention --lora-slots bundle, an adapter and sparse", "sl1", 1, ["--device", "cuda"], None,
             None),
            ("--steps 6,4 bundle serving its default, 6 steps", "t1", 1, ["--device", "cuda"], None, None),
            (f"--steps 6,4 bundle serving {SHORT_STEPS} steps", "t1", 1,
             ["--device", "cuda", "--steps", str(SHORT_STEPS)], None, None),
            ("serve: sp=1 bundle behind the API", "b1", 1, ["serve"], None, None),
            ("serve: 2 replica groups of the sp=1 bundle", "b1", 2, ["serve", "--gpus", "2", "--replicas", "2"], None,
             None),
            ("serve: sp=2 bundle, one group of 2 ranks", "b2", 2, ["serve", "--gpus", "2"], None, None),
        ]
        skipped: dict[str, int] = {}  # rows --only leaves out, with the GPUs they need
        if args.only is not None:
            wanted = [text for text in args.only.split("|") if text]
            skipped = {p[0]: p[2] for p in plan if not any(text in p[0] for text in wanted)}
            plan = [p if p[0] not in skipped else (p[0], p[1], 99, *p[3:]) for p in plan]  # 99 GPUs: never run
        bundles = {"b1": ["--steps", str(STEPS)], "b2": ["--steps", str(STEPS), "--sp", "2"],
                   "s1": ["--steps", str(STEPS), *SPARSE], "l1": ["--steps", str(STEPS), "--lora-slots", "1",
                                                                  "--lora-max-rank", "4"],
                   "t1": ["--steps", f"{STEPS},{SHORT_STEPS}"]}
        bundles["sl1"] = [*bundles["s1"], "--lora-slots", "1", "--lora-max-rank", "4"]
        adapter = write_adapter(work / "style.safetensors")
        styled = work / "styled.jsonl"  # the adapter row's batch: the same request with the adapter, and without
        styled.write_text("".join(json.dumps({"id": i, "task": "t2va", "prompt": PROMPT, "seed": SEED, "steps": STEPS,
                                              **extra}) + "\n"
                                  for i, extra in (("styled", {"lora": [{"name": "style"}]}), ("plain", {}))))
        adapter_flags = ["--adapter", f"style={adapter}:{ADAPTER_SCALE}"]
        # The same batch with the sparse bundle's settings on each line (a --requests file takes no speed flags): the
        # eager reference of row sl1, whose bundle gives its lines these settings as its defaults.
        styled_sparse = work / "styled_sparse.jsonl"
        styled_sparse.write_text("".join(json.dumps({**json.loads(line), "sparse_attention": float(SPARSE[1]),
                                                     "sparse_dense_steps": int(SPARSE[3]),
                                                     "sparse_min_seq": int(SPARSE[5])}) + "\n"
                                         for line in styled.read_text().splitlines()))
        calib = work / "calib.txt"
        calib.write_text(f"{PROMPT}\nwaves on a rocky shore, gulls calling\n")
        fp8 = ["--precision", "fp8", "--fp8-attention", "--calib-prompts", str(calib)]
        bundles["f2"] = ["--steps", str(STEPS), "--sp", "2", *fp8]
        bundles["s8"] = ["--steps", str(STEPS), *fp8, *SPARSE, "--sparse-kernel",
                         "fp8_emulated" if args.cpu else "fp8"]
        built = {}
        wanted = [name for name in bundles if any(b == name and needs <= gpus for _, b, needs, *_ in plan)]
        for name in bundles.keys() - set(wanted):
            built[name] = (-1, f"not built: no row this machine can run serves it ({gpus} GPU(s))")
            log.write(f"{name}: {built[name][1]}\n")
        # The tiny bundles build side by side (their time is Inductor's compiles, on the host's cores): a quarter of
        # the cores each, so a 16-core GPU host builds four at once and a 2-core machine one at a time.
        with ThreadPoolExecutor(max_workers=max(1, (os.cpu_count() or 1) // 4)) as pool:
            jobs = {name: pool.submit(sh, h3 + ["build", "--model", "tiny", "--device", dev, "--output",
                                                str(work / name)] + bundles[name], env, log) for name in wanted}
            built.update({name: job.result() for name, job in jobs.items()})

        def save(rows: list[dict], finished: bool) -> dict:
            """The table so far, written after every row: a run cut short (a device call's time limit) keeps the
            rows it finished, marked incomplete."""
            failed = [r for r in rows if r["status"] != "PASS"]
            result = {"device": "cpu (dry run)" if args.cpu else torch.cuda.get_device_name(0), "gpus": gpus,
                      "torch": torch.__version__, "steps": STEPS, "control_other_seed": control,
                      "min_psnr_db": args.min_psnr, "margin_db": args.margin, "rows": rows,
                      "passed": finished and not failed, "finished": finished}
            args.json.write_text(json.dumps(result, indent=1))
            return result

        guided_ref = sparse_ref = short_ref = None
        styled_ref = work / "eager_styled"  # the eager clips of the adapter row's batch, made when it first runs
        styled_sparse_ref = work / "eager_styled_sparse"  # the same with the sparse flags (row sl1)
        for i, (name, bundle, needs, flags, env_over, argv) in enumerate(plan):
            save(rows, False)
            row = {"row": name, "gpus": skipped.get(name, needs)}
            out = work / f"row{i}.mp4"
            if bundle is not None and built[bundle][0] not in (0, -1):  # -1: not built, no runnable row needs it
                row.update(status="FAIL", why=f"build {bundle} failed: {built[bundle][1].strip().splitlines()[-1:]}")
                rows.append(row)
                continue
            source = ["--engine", str(work / bundle)] if bundle else []
            want = [(out, ref)]
            if flags[:1] == ["serve"]:
                rc, text = (serve_clips(h3, work / bundle, flags[1:], work / f"row{i}", env, log)
                            if gpus >= needs else (-1, f"needs {needs} GPUs, {gpus} visible"))
                want = [(work / f"row{i}" / "one.mp4", ref), (work / f"row{i}" / "two.mp4", other)]
            elif "--replicas" in flags:
                rc, text = (sh(h3 + ["run", "--engine", str(work / bundle), "--requests", str(batch), "--out-dir",
                                     str(work / f"row{i}"), "--quiet"] + flags, env, log) if gpus >= needs
                            else (-1, f"needs {needs} GPUs, {gpus} visible"))
                want = [(work / f"row{i}" / "one.mp4", ref), (work / f"row{i}" / "two.mp4", other)]
            elif "--guidance" in flags:
                # Guidance changes the clip: the reference is the same guided request on one GPU (cfg=1).
                if guided_ref is None and gpus >= needs:
                    guided_ref = work / "eager_guided.mp4"
                    sh(h3 + ["run", "--prompt", PROMPT, "--seed", str(SEED), "--steps", str(STEPS), "--quiet",
                             "--device", dev, "--guidance", "4", "--negative-prompt", "blurry", "--output",
                             str(guided_ref)], env, log)
                rc, text = run_clip(name, source + flags, out, needs, env_over, argv)
                want = [(out, guided_ref)]
            elif bundle in SPARSE_BUNDLES and "--sparse-attention" not in flags:
                # The bundle's default sparsity: the reference is the eager clip with the same sparse settings.
                if sparse_ref is None and gpus >= needs:
                    sparse_ref = work / "eager_sparse.mp4"
                    sh(h3 + ["run", "--prompt", PROMPT, "--seed", str(SEED), "--steps", str(STEPS), "--quiet",
                             "--device", dev, *SPARSE, "--output", str(sparse_ref)], env, log)
                rc, text = run_clip(name, source + flags, out, needs, env_over, argv)
                want = [(out, sparse_ref)]
            elif bundle in ("l1", "sl1"):
                # The reference: the eager model with the same adapter named by the same request (--adapter); for
                # sl1 with the bundle's sparse flags too (its default sparsity, which the batch's lines take).
                eager_dir, lines = (styled_sparse_ref, styled_sparse) if bundle == "sl1" else (styled_ref, styled)
                if not eager_dir.exists() and gpus >= needs:
                    sh(h3 + ["run", "--requests", str(lines), "--out-dir", str(eager_dir), "--quiet", "--device",
                             dev] + adapter_flags, env, log)
                rc, text = (sh(h3 + ["run", "--engine", str(work / bundle), "--requests", str(styled), "--out-dir",
                                     str(work / f"row{i}"), "--quiet", "--device", dev] + adapter_flags, env, log)
                            if gpus >= needs else (-1, f"needs {needs} GPUs, {gpus} visible"))
                want = [(work / f"row{i}" / "styled.mp4", eager_dir / "styled.mp4"),
                        (work / f"row{i}" / "plain.mp4", eager_dir / "plain.mp4" if bundle == "sl1" else ref)]
            elif bundle == "t1" and "--steps" in flags:
                if short_ref is None and gpus >= needs:  # the eager clip of the short schedule
                    short_ref = work / "eager_short.mp4"
                    sh(h3 + ["run", "--prompt", PROMPT, "--seed", str(SEED), "--steps", str(SHORT_STEPS), "--quiet",
                             "--device", dev, "--output", str(short_ref)], env, log)
                rc, text = run_clip(name, source + flags, out, needs, env_over, argv)
                want = [(out, short_ref)]
            else:
                rc, text = run_clip(name, source + flags, out, needs, env_over, argv)
            if rc == -1:
                row.update(status="NOT RUN", why=f"not selected by --only {args.only!r}" if name in skipped else text)
            elif rc != 0:
                tail = [ln for ln in text.strip().splitlines() if ln.strip()][-1:] or ["(no output)"]
                row.update(status="FAIL", why=f"exit {rc}: {tail[0][:200]}")
            else:
                row.update(judge(want, control, args, bundle, flags, out, work / f"row{i}",
                                 styled_sparse_ref if bundle == "sl1" else styled_ref, ref))
            rows.append(row)

    failed = [r for r in rows if r["status"] != "PASS"]
    result = save(rows, True)
    print(f"{'row':<52} {'GPUs':>4}  {'status':<8} {'PSNR dB':>8} {'audio SNR':>9}  note")
    for r in rows:
        print(f"{r['row']:<52} {r['gpus']:>4}  {r['status']:<8} {r.get('psnr_db', ''):>8} "
              f"{r.get('audio_snr_db', ''):>9}  {r.get('why', '')}")
    print(f"control (other seed vs eager): PSNR {control['psnr_db']} dB; {len(rows) - len(failed)}/{len(rows)} rows "
          f"passed on {gpus} x {result['device']}; log {log_path}")
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
