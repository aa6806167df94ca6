"""``make gpu-check``'s numbers turned into its report and verdict (``benchmarks/gpu.py`` measures them on a GPU):
the GPT sizes it trains, the bit-for-bit comparison of two runs' states by digest, the report's lines and whether
the check passed. Nothing here needs a GPU, so the tests check it on any machine."""

from __future__ import annotations

import hashlib

import torch

from lightning_bamboo.models.gpt import GPTConfig, gpt_layers

__all__ = ["BLOCK", "LARGEST_BYTES_PER_PARAMETER", "LARGEST_RESERVE", "MANY", "MODES", "SIZES_MIB", "VOCAB", "digests",
           "gpt_parameters", "largest_layers", "passed", "report", "same_states"]

#: the check's GPT: its vocabulary and positions
VOCAB, BLOCK = 8192, 256

#: the NCCL layer's all-reduce against torch's own group at these sizes (MiB), and how many operations of as many
#: sizes its buffers are counted after
SIZES_MIB = (1, 64, 256)
MANY = 200

#: the redundancy modes the pipeline part times
MODES = ("off", "lazy", "eager")

#: bytes per parameter of the job on the GPU, both processes together: each holds its stage and its successor's
#: replica (together: every parameter once) at 16 bytes a parameter (fp32 master weights, gradients, AdamW's two
#: moments) and the bf16 copies its forwards cast under autocast (2 more)
LARGEST_BYTES_PER_PARAMETER = 2 * (16 + 2)

#: the share of the GPU kept for activations, the CUDA contexts and the transfer buffers
LARGEST_RESERVE = 0.2


def gpt_parameters(n_embd: int, n_layer: int) -> int:
    """The parameters of ``models.gpt``'s GPT of this shape (vocabulary ``VOCAB``, ``BLOCK`` positions)."""
    with torch.device("meta"):
        layers = gpt_layers(GPTConfig(vocab_size=VOCAB, block_size=BLOCK, n_layer=n_layer,
                                      n_head=max(1, n_embd // 128), n_embd=n_embd))
    return sum(p.numel() for layer in layers for p in layer.parameters())


def largest_layers(total_bytes: int, n_embd: int) -> int:
    """The most blocks of width ``n_embd`` whose 2-stage job with replicas fits a GPU of ``total_bytes``, by
    ``LARGEST_BYTES_PER_PARAMETER`` and ``LARGEST_RESERVE`` (the run says whether it did)."""
    allowed = total_bytes * (1 - LARGEST_RESERVE) / LARGEST_BYTES_PER_PARAMETER
    base, block = gpt_parameters(n_embd, 0), gpt_parameters(n_embd, 1) - gpt_parameters(n_embd, 0)
    return max(2, int((allowed - base) // block))


def digests(states: dict) -> dict:
    """Per layer, a digest of the bytes of every weight and optimizer-state tensor (equal digests: equal bits)."""
    def digest(value) -> str:
        tensor = torch.as_tensor(value).detach().cpu().contiguous()
        return hashlib.blake2b(tensor.view(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"",
                               digest_size=16).hexdigest() + f"/{tensor.dtype}/{tuple(tensor.shape)}"

    return {str(layer): {"weights": {name: digest(t) for name, t in state["weights"].items()},
                         "optimizer": {name: {key: digest(v) for key, v in param["state"].items()}
                                       for name, param in state["optimizer"].items()}}
            for layer, state in states.items()}


def same_states(a: dict, b: dict) -> bool:
    """Whether two runs' layers (``digests`` by layer) hold the same bits: every layer, weight and state."""
    return bool(a) and a == b


def report(results: dict, kill_at: int, skip_pipeline: bool) -> list[str]:
    """The human-readable lines for ``results`` (what ``comm_part`` and ``pipeline_part`` measured): pure, so that
    its form is tested on a machine without a GPU (``tests/test_gpu_check.py``). A number not measured reads nan."""
    nan = float("nan")
    lines = [
        f"GPU: {results['gpu']}, torch {results['torch']}, NCCL {results['nccl']}",
        f"host transport, 4 MiB round trip between two processes on the GPU: "
        f"{results.get('host_round_trip_4mib_ms', nan):.2f} ms",
        "NCCL transport, all-reduce (one rank), through the layer / native (target at 64 MiB: 1.10x): " + ", ".join(
            f"{mib} MiB {results.get(f'nccl_layer_allreduce_{mib}mib_ms', nan):.3f} / "
            f"{results.get(f'nccl_native_allreduce_{mib}mib_ms', nan):.3f} ms "
            f"({results.get(f'nccl_layer_allreduce_{mib}mib_ms', nan) / results.get(f'nccl_native_allreduce_{mib}mib_ms', nan):.2f}x)"
            for mib in SIZES_MIB),
        f"NCCL transport, {MANY} all-reduces of {MANY} sizes (1-1.8 MiB): transfer buffers "
        f"{results.get('nccl_buffers_after_many_mib', nan):.1f} MiB, GPU memory reserved "
        f"+{results.get('nccl_reserved_growth_mib', nan):.1f} MiB; after a trim "
        f"{results.get('nccl_buffers_after_trim_mib', nan):.1f} MiB",
        f"abort: host transport receive on a frozen peer {results.get('host_abort_s', nan):.3f} s, NCCL "
        f"all-reduce without its peer {results.get('nccl_abort_s', nan):.3f} s (blocked before: "
        f"{results.get('nccl_blocked_before_abort')}); next NCCL generation's first all-reduce "
        f"{results.get('nccl_next_generation_s', nan):.2f} s",
    ]
    if not skip_pipeline:
        lines.append(f"pipeline, 2 stages of {results.get('stage_parameters', 0) / 1e9:.2f}B parameters (stage 0) "
                     "sharing the GPU, fp32, AdamW: step " + ", ".join(
                         f"{mode} {results.get(f'step_{mode}_ms', nan):.1f} ms" for mode in MODES)
                     + f" (lazy {results.get('lazy_over_off', nan):.3f}x, eager {results.get('eager_over_off', nan):.3f}x)"
                     "; peak memory of a process " + ", ".join(
                         f"{mode} {results.get(f'peak_{mode}_gib', nan):.2f} GiB" for mode in MODES))
        if "peak_lazy_host_gib" in results:
            lines.append(f"lazy with the replica in pinned host memory (replica_placement='host'): peak memory of a "
                         f"process {results['peak_lazy_host_gib']:.2f} GiB, {results['lazy_host_over_off_peak']:.3f}x "
                         "of off's (issue 64's target: at most 1.05x)")
        lines.append(f"snapshot of stage 0 to host memory (the asynchronous checkpoint's pause): "
                     f"{results.get('snapshot_s', nan):.3f} s ({results.get('snapshot_first_s', nan):.3f} s the "
                     "first, which allocates its buffers)")
        if results.get("not_run"):
            lines.append(f"not run within the time budget: {', '.join(results['not_run'])}")
        for how, what in (("kill", "SIGKILLed"), ("freeze", "frozen (SIGSTOP; detection timeout 3 s)")):
            lines.append(f"node1 {what} at step {kill_at}: exit codes {results.get(f'{how}_codes')}, failovers "
                         f"{results.get(f'{how}_failovers')}, that step {results.get(f'{how}_step_s', nan):.2f} s, "
                         f"final weights and AdamW state equal to the clean lazy run: "
                         f"{results.get(f'exact_after_{how}')}")
    if "largest_tried" in results:
        tried = ", ".join(f"{layers} blocks {'fit' if fit else 'did not fit'}" for layers, fit in results["largest_tried"])
        lines.append(
            f"largest GPT on the GPU in 2 stages sharing it, bf16, lazy, AdamW: "
            f"{results.get('largest_parameters', 0) / 1e9:.2f}B parameters ({results.get('largest_layers')} blocks x "
            f"{results.get('largest_width')}), step {results.get('largest_step_ms', nan):.1f} ms, peak memory of a "
            f"process {results.get('largest_peak_gib', nan):.2f} GiB (tried: {tried})")
    return lines


def passed(results: dict, skip_pipeline: bool) -> bool:
    """The check's verdict: both aborts within 1 s, and (with the pipeline part) both failovers bit-exact."""
    return (results.get("host_abort_s", 9) < 1.0 and results.get("nccl_abort_s", 9) < 1.0
            and (skip_pipeline or (results.get("exact_after_kill") is True
                                   and results.get("exact_after_freeze") is True)))

