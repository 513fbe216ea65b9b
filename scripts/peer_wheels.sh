#!/usr/bin/env bash
# The wheels Unsloth 2026.10.9 needs on the GPU machine beyond what its image already has, for
# `tigon bench --e2e --e2e-impls ... unsloth` and `tigon bench --max-context` with the unsloth variant.
# Run here (where pip reaches the registry), not on the GPU machine (which reaches nothing):
#
#   bash scripts/peer_wheels.sh [DIR]          # default DIR: .whl-peers (git-ignored)
#
# then carry DIR to the GPU machine and install it there without an index:
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl-peers/*.whl
#   export PYTHONPATH=src:/tmp/site
#
# The image has torch 2.11 (CUDA 13), triton 3.6, transformers 5.17, peft 0.21, accelerate, pandas,
# pyarrow, torchvision, fsspec, xxhash, httpx, jinja2, click and the rest of Unsloth's common
# requirements; what it lacks is listed in PEERS below (each wheel's Requires-Dist was read: the
# pins of pydantic-core and of trl/datasets follow Unsloth's and pydantic's). xformers and diffusers
# are left out: Unsloth imports xformers only if present, and diffusers only for diffusion models.
#
# A GPU call carries at most 64 MiB, so the two big wheels are slimmed, their RECORD rewritten to
# match (pip then installs them as usual): unsloth without its `studio/` tree (the web UI, ~85 MB
# unpacked, never imported by training), bitsandbytes with only the CUDA 13.0 library
# (libbitsandbytes_cuda130.so) and its CPU one. The script ends by printing every wheel's size, the
# total (it fails above 60 MiB), and any requirement that neither the image nor DIR provides.
set -euo pipefail
DIR=${1:-.whl-peers}
PEERS=(
  unsloth==2026.10.9 unsloth_zoo==2026.10.9 bitsandbytes==0.50.2 torchao==0.18.0 cut_cross_entropy==25.1.1
  "trl<=1.15.0,>=0.18.2" "datasets<5.0.0,>=4.7.0" dill==0.4.1 multiprocess==0.70.19
  tyro docstring-parser typeguard shtab msgspec hf_transfer structlog json5 nest-asyncio
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection
)
mkdir -p "$DIR"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$DIR" "${PEERS[@]}"

python3 - "$DIR" <<'PY'
import base64, csv, hashlib, io, re, sys, zipfile
from pathlib import Path

folder = Path(sys.argv[1])
# What each big wheel keeps: unsloth drops its web UI; bitsandbytes keeps only CUDA 13.0's and the CPU library.
DROP = {
    "unsloth": lambda name: name.startswith("studio/"),
    "bitsandbytes": lambda name: re.fullmatch(r"bitsandbytes/libbitsandbytes_(?!cuda130\.so$|cpu\.so$).*\.so", name) is not None,
}


def slim(wheel: Path, drop) -> None:
    with zipfile.ZipFile(wheel) as src:
        infos = [i for i in src.infolist() if not drop(i.filename)]
        if len(infos) == len(src.infolist()):
            return  # slimmed already (a rerun)
        record = next(i for i in infos if i.filename.endswith(".dist-info/RECORD"))
        rows = [r for r in csv.reader(io.StringIO(src.read(record).decode())) if r and not drop(r[0])]
        text = io.StringIO()
        csv.writer(text, lineterminator="\n").writerows(rows)
        tmp = wheel.with_suffix(".tmp")
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as out:
            for info in infos:
                data = text.getvalue().encode() if info is record else src.read(info)
                out.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
    tmp.replace(wheel)
    # every kept file's hash still matches its RECORD row: pip checks them on install
    with zipfile.ZipFile(wheel) as check:
        for row in csv.reader(io.StringIO(check.read(record.filename).decode())):
            if len(row) == 3 and row[1]:
                algo, digest = row[1].split("=", 1)
                got = base64.urlsafe_b64encode(hashlib.new(algo, check.read(row[0])).digest()).rstrip(b"=").decode()
                assert got == digest, f"{wheel.name}: {row[0]} does not match its RECORD"


def dist(wheel: Path) -> str:
    return re.sub(r"[-_.]+", "-", wheel.name.split("-")[0]).lower()


for wheel in sorted(folder.glob("*.whl")):
    if dist(wheel) in DROP:
        slim(wheel, DROP[dist(wheel)])

IMAGE = """torch triton transformers peft accelerate typer rich pyyaml psutil sentencepiece protobuf numpy einops
pillow regex requests filelock huggingface-hub hf-xet safetensors tqdm pandas pyarrow torchvision fsspec xxhash
httpx aiohttp jinja2 click certifi packaging wheel typing-extensions xformers diffusers""".split()
have = set(IMAGE) | {dist(w) for w in folder.glob("*.whl")}
total = 0
for wheel in sorted(folder.glob("*.whl")):
    size = wheel.stat().st_size
    total += size
    with zipfile.ZipFile(wheel) as zf:
        meta = zf.read(next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    needs = []
    for line in meta.splitlines():
        if line.startswith("Requires-Dist:") and "extra ==" not in line and "darwin\" and" not in line \
                and "win32\" and" not in line and "< '3.1" not in line and "< \"3.1" not in line:
            name = re.sub(r"[-_.]+", "-", re.match(r"Requires-Dist:\s*([A-Za-z0-9_.\-]+)", line).group(1)).lower()
            if name not in have and name not in ("triton-windows",):
                needs.append(name)
    print(f"{size / 2**20:8.2f} MiB  {wheel.name}" + (f"   (not provided: {', '.join(needs)})" if needs else ""))
print(f"{total / 2**20:8.2f} MiB  total in {folder}")
sys.exit(1 if total > 60 * 2**20 else 0)
PY
