"""The Megatron features the launcher runs (sequence parallelism, the distributed and mixed-precision optimizers, a
Llama-style model, MoE token dispatch), in one process (gloo, world size 1): what each one must never have swapped is
protected, and the Llama-style pieces are the ones Megatron-LM's flags ask for. The multi-rank runs (bit-identical
with and without Chameleon, within a capacity, Stable) are in test_megatron_ranks.py."""

from __future__ import annotations

import inspect

import pytest
import torch

gpt = pytest.importorskip("chameleon_dist.integrations.megatron.gpt")
from megatron.core import parallel_state  # noqa: E402
from megatron.core.distributed import DistributedDataParallel  # noqa: E402
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer  # noqa: E402
from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params  # noqa: E402
from megatron.core.tensor_parallel import layers, mappings  # noqa: E402
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher  # noqa: E402

from chameleon_dist.device.meter import storage_key  # noqa: E402
from chameleon_dist.integrations.megatron.install import installed  # noqa: E402
from launch import train_megatron  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

SEED = 11
CONFIG = {"device": {"kind": "emulated", "capacity": "1GB"}, "min_swap_bytes": "1KiB"}
SMALL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--vocab-size", "64", "--micro-batch-size", "2"]
LLAMA = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--group-query-attention",
         "--num-query-groups", "2", "--untie-embeddings-and-output-weights", "--disable-bias-linear"]


def _chunks_and_optimizer(argv: list[str]):
    args = train_megatron.parse_args([*SMALL, *argv], world_size=1)
    chunks = train_megatron.build_chunks(args, train_megatron.shape_for(args, args.seq_length), on_cpu=True)
    return args, chunks, train_megatron.build_optimizer(args, chunks)


@pytest.mark.parametrize("argv, kind", [(["--bf16", "--use-distributed-optimizer"], DistributedOptimizer),
                                        (["--fp16"], Float16OptimizerWithFloat16Params)])
def test_the_optimizers_main_parameters_and_buffers_are_protected_and_counted(argv, kind):
    """Megatron's optimizer keeps fp32 main parameters beside the 16-bit model (this rank's shards under the
    distributed optimizer; its parameter all-gathers go to the DDP buckets' param_data): none of it is swapped, and
    the emulated device counts it from the start (it was made before install)."""
    with gpt.megatron_cpu_session(seed=SEED):
        _args, chunks, optimizer = _chunks_and_optimizer(argv)
        (inner,) = getattr(optimizer, "chained_optimizers", [optimizer])
        assert isinstance(inner, kind)
        main = [p for group in inner.optimizer.param_groups for p in group["params"]]
        model = {storage_key(p.untyped_storage()) for p in chunks[0].parameters()}
        assert main and all(p.dtype == torch.float32 for p in main)
        assert not {storage_key(p.untyped_storage()) for p in main} & model  # their own storages
        with installed(chunks, CONFIG, optimizer=optimizer, cuda_literals_on_cpu=True) as chameleon:
            protected = chameleon.executor.protected_keys()
            assert all(storage_key(p.untyped_storage()) in protected for p in main)
            ddp: DistributedDataParallel = chunks[0]
            buckets = [bucket for buffer in ddp.buffers for bucket in buffer.buckets]
            gathered = [b.param_data for b in buckets if b.param_data is not None]
            assert bool(gathered) == (kind is DistributedOptimizer)  # param_data exists under the distributed optimizer
            assert all(storage_key(t.untyped_storage()) in protected for t in [*gathered, *(b.grad_data for b in buckets)])
            main_bytes = sum(p.untyped_storage().nbytes() for p in main)
            grad_bytes = sum(b.grad_data.untyped_storage().nbytes() for b in ddp.buffers)
            assert chameleon.device.live_bytes() >= main_bytes + grad_bytes


def test_the_sequence_parallel_all_gather_lands_in_a_protected_workspace():
    """Under sequence parallelism each column-parallel linear all-gathers its sequence-sharded input into Megatron's
    GlobalMemoryBuffer (forward, and again in backward), reused by the next layer: protected the moment it is
    handed out. (On one rank the linear is called directly: ColumnParallelLinear turns SP off at TP 1.)"""
    assert "get_global_memory_buffer().get_tensor" in inspect.getsource(
        layers.LinearWithGradAccumulationAndAsyncCommunication.forward)
    with gpt.megatron_cpu_session(seed=SEED):
        shape = gpt.TransformerShape(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=64,
                                     seq_length=16, micro_batch_size=2)
        model = gpt.build_gpt(shape, seed=SEED)
        with installed([model], CONFIG, cuda_literals_on_cpu=True) as chameleon:
            with chameleon.runtime.iteration():
                x = torch.randn(16, 2, 32, requires_grad=True)
                weight = torch.randn(64, 32, requires_grad=True)
                y = layers.linear_with_grad_accumulation_and_async_allreduce(
                    x, weight, None, gradient_accumulation_fusion=False, allreduce_dgrad=False, sequence_parallel=True,
                    tp_group=parallel_state.get_tensor_model_parallel_group())
                workspace = parallel_state.get_global_memory_buffer().buffer[("mpu", torch.float32)]
                assert chameleon.executor.is_protected(workspace)
                y.square().sum().backward()
            assert storage_key(workspace.untyped_storage()) in chameleon.executor.protected_keys()
        assert torch.equal(x.grad, (2 * y.detach()) @ weight.detach())


def test_moe_token_dispatch_gathers_into_the_global_buffer():
    """The allgather dispatcher (TP or EP > 1) gathers every rank's tokens into the same GlobalMemoryBuffer
    workspace, protected when handed out (above); this fails if upstream stops doing so (re-check the protection)."""
    assert "use_global_buffer=True" in inspect.getsource(MoEAllGatherTokenDispatcher.token_dispatch)
    assert "get_global_memory_buffer().get_tensor" in inspect.getsource(mappings._gather_along_first_dim)


@pytest.mark.parametrize("normalization, norm_class", [("LayerNorm", torch.nn.LayerNorm), ("RMSNorm", torch.nn.RMSNorm)])
def test_sequence_parallel_norms_carry_the_mark_finalize_model_grads_reduces(normalization, norm_class):
    """Megatron refuses SP without TP, so on one rank: the block build_gpt makes under SP (every norm of the local
    spec replaced) and the norm's mark, which finalize_model_grads all-reduces over the tensor-parallel ranks."""
    with gpt.megatron_cpu_session(seed=SEED):
        shape = gpt.TransformerShape(num_layers=3, hidden_size=32, num_attention_heads=4, vocab_size=64,
                                     seq_length=16, micro_batch_size=2)
        config = gpt.transformer_config(shape, normalization=normalization)
        config.sequence_parallel = True
        block = gpt._sequence_parallel_block(gpt._layer_spec(None, {"normalization": normalization}), config, None)
        assert len(block.layer_specs) == 3 and block.layer_norm is gpt.SequenceParallelNorm
        assert all(spec.submodules.input_layernorm is gpt.SequenceParallelNorm
                   and spec.submodules.pre_mlp_layernorm is gpt.SequenceParallelNorm for spec in block.layer_specs)
        norm = gpt.SequenceParallelNorm(config, 32, eps=1e-5)
        assert isinstance(norm, norm_class) and all(p.sequence_parallel for p in norm.parameters())
        plain = gpt.build_gpt(shape, seed=SEED, normalization=normalization)
        assert not any(getattr(p, "sequence_parallel", False) for p in plain.parameters())


def test_llama_style_flags_build_rope_rmsnorm_swiglu_and_grouped_query_attention():
    with gpt.megatron_cpu_session(seed=SEED):
        args, (ddp,), _ = _chunks_and_optimizer([*LLAMA, "--fp16"])
        model = ddp.module.module  # DistributedDataParallel(Float16Module(GPTModel))
        config = model.config
        assert (config.normalization, config.gated_linear_unit, config.num_query_groups, config.fp16) == (
            "RMSNorm", True, 2, True)
        assert config.activation_func is torch.nn.functional.silu and not config.add_bias_linear
        assert model.position_embedding_type == "rope" and not model.share_embeddings_and_output_weights
        layer = model.decoder.layers[0]
        head_dim = args.hidden_size // args.num_attention_heads
        assert layer.self_attention.linear_qkv.weight.shape[0] == (4 + 2 * 2) * head_dim  # 4 query, 2+2 key/value heads
        assert layer.mlp.linear_fc1.weight.shape[0] == 2 * args.ffn_hidden_size  # gate and up projections
        assert isinstance(layer.input_layernorm, torch.nn.RMSNorm) and layer.input_layernorm.weight.dtype == torch.float16
        batch = gpt.synthetic_batch(train_megatron.shape_for(args, args.seq_length), 0, SEED)
        out = ddp(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
        assert out.dtype == torch.float32 and torch.isfinite(out).all()  # Float16Module hands back fp32
