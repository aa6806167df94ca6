"""Tied layers (``TiedLayerSpec``), in one process: every copy of a tied module starts equal, runs its own
``forward_fn``, and gets the sum of the copies' gradients in layer order; a global norm counts it once; a
consolidated checkpoint holds it once. (Through real failovers: ``tests/test_tied_mp.py``.)"""

from __future__ import annotations

import pytest
import torch
from deepspeed.pipe import LayerSpec, TiedLayerSpec
from torch import nn

from lightning_bamboo import checkpoint as ckpt
from lightning_bamboo.engine.module import build_layers, census_layers, is_tied_copy
from lightning_bamboo.engine.precision import layer_square_norms
from lightning_bamboo.engine.ties import reduce_tied_gradients
from lightning_bamboo.errors import BambooConfigError
from lightning_bamboo.models.gpt import Embedding, GPTConfig, gpt_layer_specs, gpt_loss

CFG = GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=32)
SEED = 7


def specs():
    return gpt_layer_specs(CFG, tie_embeddings=True)  # [embed, block, final norm, embed as the head]


def stage(layers):
    module = nn.Module()
    for index, layer in layers.items():
        module.add_module(str(index), layer)
    return module


def backward(layers, seed=0):
    tokens = torch.randint(0, CFG.vocab_size, (2, CFG.block_size), generator=torch.Generator().manual_seed(seed))
    x = tokens
    for layer in layers:
        x = layer(x)
    gpt_loss(x, tokens).backward()


def _copy(grad):
    return grad.clone() if grad is not None else None


def test_every_copy_of_a_tied_module_is_built_as_its_first_layer_and_runs_its_own_forward():
    built = build_layers(specs, SEED)
    assert built.ties == {"embed": (0, 3)} and built.names == ["Embedding", "Block", "FinalNorm", "Embedding"]
    embed, head = built.layers[0], built.layers[3]
    assert embed is not head and embed.tok.weight is not head.tok.weight
    for name, value in embed.state_dict().items():
        assert torch.equal(value, head.state_dict()[name]), name
    # built under the first layer's seed (DeepSpeed builds it on the first stage and broadcasts it), not the last's
    alone = build_layers(lambda: [LayerSpec(Embedding, CFG, init_std=0.02)] * 4, SEED).layers
    assert torch.equal(embed.tok.weight, alone[0].tok.weight) and not torch.equal(head.tok.weight, alone[3].tok.weight)
    x = torch.randn(2, CFG.block_size, CFG.n_embd)
    assert torch.equal(head(x), x @ embed.tok.weight.T)  # the head's forward_fn: logits from the token embedding
    assert not any(is_tied_copy(p) for p in embed.parameters()) and all(is_tied_copy(p) for p in head.parameters())
    # a process builds only the copy it keeps, and the census counts a copy wherever one is kept
    kept = build_layers(specs, SEED, keep=lambda i: i == 3).layers
    assert kept[:3] == [None, None, None] and torch.equal(kept[3].tok.weight, embed.tok.weight)
    census = census_layers(specs, SEED)
    assert census.ties == built.ties and census.param_counts[0] == census.param_counts[3] == 2304


def test_the_copies_get_the_sum_of_their_gradients_in_layer_order_and_the_norm_counts_them_once():
    layers = build_layers(specs, SEED).layers
    backward(layers)
    embed, head = layers[0], layers[3]
    own = {name: (embed.get_parameter(name).grad.clone(), _copy(head.get_parameter(name).grad))
           for name, _ in embed.named_parameters()}
    assert own["pos.weight"][1] is None  # the head never uses the position embedding
    unreduced = layer_square_norms(stage(dict(enumerate(layers))), 4, torch.device("cpu"))
    reduce_tied_gradients(stage(dict(enumerate(layers))), {"embed": (0, 3)}, rank_of_layer=lambda i: 0)
    for name, (first, last) in own.items():
        expected = first + last if last is not None else first + torch.zeros_like(first)
        assert torch.equal(embed.get_parameter(name).grad, expected), name
        assert torch.equal(head.get_parameter(name).grad, expected), name
    squares = layer_square_norms(stage(dict(enumerate(layers))), 4, torch.device("cpu"))
    assert squares[3] == 0 and unreduced[3] == 0 and squares[0] > unreduced[0] > 0  # once, at layer 0, the sum
    assert torch.equal(squares[1:3], unreduced[1:3])


def test_the_sum_is_the_same_bit_for_bit_whether_one_stage_holds_both_copies_or_each_its_own():
    """A failover can merge the first and the last stage: the copies' sum must not depend on where they live."""
    layers = build_layers(specs, SEED).layers
    backward(layers, seed=1)
    backward(layers, seed=2)  # two micro-batches: each copy accumulates its own uses
    grads = {i: [p.grad.clone() if p.grad is not None else None for p in layers[i].parameters()] for i in (0, 3)}
    reduce_tied_gradients(stage({0: layers[0], 3: layers[3]}), {"embed": (0, 3)}, rank_of_layer=lambda i: 0)
    together = [p.grad.clone() for p in layers[3].parameters()]
    for i in (0, 3):  # again, as two stages would sum them: each adds the other's to its own, the first layer's first
        for p, g in zip(layers[i].parameters(), grads[i], strict=True):
            p.grad = g
    first, last = ([g if g is not None else torch.zeros_like(p) for p, g in zip(layers[i].parameters(), grads[i],
                                                                               strict=True)] for i in (0, 3))
    assert all(torch.equal(a + b, t) for a, b, t in zip(first, last, together, strict=True))


def test_tied_layers_of_different_classes_are_refused_naming_both():
    def mixed():
        return [TiedLayerSpec("embed", Embedding, CFG), LayerSpec(nn.Identity),
                TiedLayerSpec("embed", nn.Linear, 4, 4)]

    with pytest.raises(BambooConfigError, match=r"TiedLayerSpec 'embed' builds a Linear at layer 2 but a Embedding at "
                                                r"layer 0: the layers of one key share one module"):
        build_layers(mixed, SEED)


def test_a_consolidated_checkpoint_holds_a_tied_module_once(tmp_path):
    layers = build_layers(specs, SEED).layers
    whole = stage(dict(enumerate(layers)))
    ckpt.write_layers(tmp_path, ckpt.layer_states(whole, None, range(4)))
    ckpt.write_meta(tmp_path, {"bamboo": ckpt.bamboo_meta(4, [0, 2, 4], 1, None, ties={"embed": (0, 3)})})
    weights = ckpt.consolidate_checkpoint(tmp_path)
    assert sorted(k for k in weights if k.startswith(("0.", "3."))) == ["0.pos.weight", "0.tok.weight"]
    assert sorted(weights) == sorted(k for k in whole.state_dict() if not k.startswith("3."))


def test_the_census_warns_when_every_process_would_build_a_large_model_whole(monkeypatch, caplog):
    from lightning_bamboo.engine import module

    monkeypatch.setattr(module, "BUILT_PARAMETERS_WARNING", 1000)
    with caplog.at_level("WARNING", logger="lightning_bamboo.engine.module"):
        census_layers(lambda: [nn.Linear(32, 32), nn.Linear(32, 32)], SEED)  # 2112 parameters, built
    assert "returned 2,112 parameters as built nn.Module layers: every process builds and holds all of them" in caplog.text
    assert "Return DeepSpeed LayerSpecs" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="lightning_bamboo.engine.module"):
        census_layers(specs, SEED)  # LayerSpecs: each process builds its own
    assert "built nn.Module layers" not in caplog.text
