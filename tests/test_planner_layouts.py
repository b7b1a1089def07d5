"""The layout search's enumeration, pinned: the same layouts in the same order (the search breaks ties by
layout order, so a reordering would change which plan is reported best). The lists and digests were
recorded from the enumeration as it stood before ``layouts()`` was restructured."""

import hashlib

import pytest

from chameleon_dist.planner import SearchSpace, load_hardware, load_model
from chameleon_dist.planner.profiles import make_setup
from chameleon_dist.planner.search import layouts


def _describe(model, hardware, devices, setup, space):
    return [layout.describe() for layout in
            layouts(load_model(model), load_hardware(hardware), make_setup(**setup), devices, space)]


def _digest(descriptions):
    return hashlib.sha256("\n".join(descriptions).encode()).hexdigest()


# flash attention (no selective), a TP that does not divide the world (3), a PP that does not divide what is
# left (16), VPP only with PP > 1
DENSE = [
    f"TP{tp} PP{pp} DP{dp}{vpp} mb{mb} {mode}"
    for tp, pp, dp, vpp, mb in [
        (1, 1, 8, "", 1), (1, 2, 4, "", 1), (1, 2, 4, "", 4), (1, 2, 4, " VPP2", 1),
        (2, 1, 4, "", 1), (2, 1, 4, "", 4), (2, 2, 2, "", 1), (2, 2, 2, "", 4), (2, 2, 2, " VPP2", 1),
        (2, 2, 2, " VPP2", 4), (8, 1, 1, "", 1), (8, 1, 1, "", 4),
    ]
    for mode in ("no-recompute", "no-recompute swap", "recompute-1-layers", "full-recompute")
]

# one layer per chunk under VPP2: no block recomputation there
ONE_LAYER_CHUNKS = [
    "TP1 PP16 DP2 mb1 no-recompute", "TP1 PP16 DP2 mb1 no-recompute swap", "TP1 PP16 DP2 mb1 recompute-1-layers",
    "TP1 PP16 DP2 mb1 full-recompute", "TP1 PP16 DP2 VPP2 mb1 no-recompute",
    "TP1 PP16 DP2 VPP2 mb1 no-recompute swap", "TP1 PP16 DP2 VPP2 mb1 full-recompute",
]


def test_dense_layouts_in_order():
    space = SearchSpace(tp=(1, 2, 3, 8), pp=(1, 2, 16), vpp=(1, 2), micro_batch=(1, 4))
    setup = dict(global_batch_size=16, seq_length=4096, attention="flash")
    assert _describe("llama2-7b", "ascend-910b", 8, setup, space) == DENSE


def test_block_recomputation_needs_two_layers_per_chunk():
    space = SearchSpace(tp=(1,), pp=(16,), vpp=(1, 2), micro_batch=(1,))
    setup = dict(global_batch_size=32, seq_length=4096)
    assert _describe("llama2-7b", "ascend-910b", 32, setup, space) == ONE_LAYER_CHUNKS


@pytest.mark.parametrize("model, hardware, devices, setup, space, count, digest", [
    # MoE with EP, unfused attention (selective allowed), the space's own value order (descending, swap first)
    ("mixtral-8x7b", "ascend-910b", 16, dict(global_batch_size=32, seq_length=4096, attention="unfused"),
     SearchSpace(tp=(2, 1), pp=(2, 1), vpp=(2, 1), micro_batch=(2,), recompute=("selective", "block", "none"),
                 swap=(True, False)),
     88, "f27303c9bbf86ff7b06b84f4493af8f5325920e2196c85f50f81b7f544cadd90"),
    # the default space at scale
    ("llama2-70b", "h100-80gb", 64, dict(global_batch_size=256, seq_length=4096), SearchSpace(),
     468, "dc6c9dc585384e6d4b770dcb95605593c47e539c043f211cc31f5ce21f0ed9b8"),
])
def test_layout_enumeration_is_pinned(model, hardware, devices, setup, space, count, digest):
    got = _describe(model, hardware, devices, setup, space)
    assert (len(got), _digest(got)) == (count, digest), got
