"""On a CUDA machine: recscale's all-to-all codecs (MXINT8, row-wise FP8 both directions) and the Platt
calibration fit give the CPU's bits on CUDA tensors; exit 1 otherwise. Writes $OUT/gpu_check.json.

    PYTHONPATH=src python bench/device_codecs.py      # needs torch with CUDA and fbgemm_gpu importable

Result on an H200 (torch 2.11+cu130, fbgemm-gpu-cpu 1.6.0 for the imports): docs/device_codecs_h200.json.
The first run found the FP8 codec's scale one ulp apart between devices (torch's CPU kernel divides by a
scalar through its reciprocal); the codec now multiplies by the reciprocal on both.
"""

import json
import os
import sys

import torch

from recscale.distributed.codecs import MXInt8Codec, RowwiseFP8Codec
from recscale.models.blocks import Calibration

if sys.argv[1:2] in (["-h"], ["--help"]):
    print(f"usage: device_codecs.py  (no arguments)\n{__doc__}")
    sys.exit(0)
if not torch.cuda.is_available():  # a one-line reason, not an AssertionError's traceback
    sys.exit("device_codecs.py: needs a CUDA device (torch.cuda.is_available() is False)")
out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
torch.manual_seed(0)
x = torch.randn(4096 * 32) * torch.logspace(-6, 3, 4096).repeat_interleave(32)
x[77] = float("nan")
for name, codec in [
    ("mxint8", MXInt8Codec(True)),
    ("fp8_fwd", RowwiseFP8Codec(True)),
    ("fp8_bwd", RowwiseFP8Codec(False)),
]:
    c1, c2 = codec.create_context(), codec.create_context()
    qc, qg = codec.encode(x, c1), codec.encode(x.cuda(), c2)
    dc, dg = codec.decode(qc, c1), codec.decode(qg, c2)
    out[name] = {
        "bytes_equal": bool(torch.equal(qc, qg.cpu())),
        "decoded_equal": bool(torch.equal(dc.nan_to_num(7.0), dg.cpu().nan_to_num(7.0))),
        "bytes": qg.numel(),
        "device": str(qg.device),
    }
z = torch.randn(100_000) * 2
y = torch.bernoulli(torch.sigmoid(0.5 * z + 0.3))
a_cpu = Calibration().fit(z, y)
cal = Calibration().cuda()
a_gpu = cal.fit(z.cuda(), y.cuda())
out["calibration"] = {
    "cpu": a_cpu,
    "cuda": a_gpu,
    "equal": a_cpu == a_gpu,
    "buffer_device": str(cal.scale.device),
    "forward_device": str(cal(z.cuda()).device),
}
print(json.dumps(out, indent=1))
ok = (
    all(out[k]["bytes_equal"] and out[k]["decoded_equal"] for k in ("mxint8", "fp8_fwd", "fp8_bwd"))
    and out["calibration"]["equal"]
)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "gpu_check.json"), "w"), indent=1)
sys.exit(0 if ok else 1)
