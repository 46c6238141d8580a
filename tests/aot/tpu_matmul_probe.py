"""Run in its own process by `test_compile.py`: a hand-countable program compiled for v5e:2x2,
and the Pallas TPU paged decode kernel compiled through Mosaic; prints one JSON line."""

import json

from treegrpo_jax.aot import targets

targets.prepare_process()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding  # noqa: E402

from treegrpo_jax.aot.programs import Program  # noqa: E402
from treegrpo_jax.aot.report import compile_program  # noqa: E402
from treegrpo_jax.model.paged_kernels import paged_attention_pallas  # noqa: E402

devices = targets.topology_devices("v5e:2x2")
chip = targets.parse_topology("v5e:2x2")
mesh = Mesh(np.asarray(devices), ("x",))
m, k, n = 1024, 2048, 512
a = jax.ShapeDtypeStruct((m, k), jnp.bfloat16, sharding=NamedSharding(mesh, PartitionSpec("x", None)))
b = jax.ShapeDtypeStruct((k, n), jnp.bfloat16, sharding=NamedSharding(mesh, PartitionSpec()))
matmul = Program("matmul", "update", lambda: jax.jit(lambda a, b: a @ b).lower(a, b), 2.0 * m * k * n, 0.0)
r = compile_program(matmul, chip, len(devices))

one = SingleDeviceSharding(devices[0])
rows, heads, kv_heads, d, pages, p, per_row = 8, 16, 2, 128, 64, 16, 16
kernel = {}
for kv in ("bfloat16", "float32"):
    args = [
        jax.ShapeDtypeStruct((rows, heads, d), jnp.bfloat16, sharding=one),
        jax.ShapeDtypeStruct((kv_heads, pages, p, d), kv, sharding=one),
        jax.ShapeDtypeStruct((kv_heads, pages, p, d), kv, sharding=one),
        jax.ShapeDtypeStruct((rows, per_row), jnp.int32, sharding=one),
        jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=one),
    ]
    fn = jax.jit(lambda *x: paged_attention_pallas(*x, platform="tpu"))
    text = fn.lower(*args).compile().as_text()
    kernel[kv] = "tpu_custom_call" in text  # the Mosaic kernel, not an XLA fallback

print(
    json.dumps(
        {
            "devices": len(devices),
            "device_kind": devices[0].device_kind,
            "compiled": r.compiled,
            "xla_flops": r.xla_flops,
            "argument_bytes": r.argument_bytes,
            "output_bytes": r.output_bytes,
            "mosaic_kernel": kernel,
        }
    )
)
