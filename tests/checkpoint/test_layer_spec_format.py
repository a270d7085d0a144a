"""One checkpoint format whatever the layer spec: a checkpoint written from Megatron's local spec (a host
without Transformer Engine) loads into a model of TE's spec and back, through the real conversions.

Without a GPU, TE's spec is stood in for by the local model with the sharded key set TE's spec gives it:
the local spec already names the layer norms as TE's fused ones (``linear_qkv.layer_norm_weight``,
``linear_fc1.layer_norm_weight``, its ``sharded_state_dict_keys_map``), and TE adds ``_extra_state``
objects for the modules the local spec has none for: the attention (``TEDotProductAttention``) and the
norms (``TENorm``, an ops module in TE 2.x), with a serialized state as their data.
"""

from __future__ import annotations

import dataclasses

import torch
from safetensors.torch import load_file

from stapo_megatron.checkpoint.convert import (
    convert_hf_to_megatron,
    convert_megatron_to_hf,
    hf_to_megatron_rank,
    megatron_to_hf_rank,
)
from stapo_megatron.checkpoint.dcp_index import METADATA_FILE, read_dcp_metadata
from tests.helpers import save_tiny_qwen3

# module of the local spec with an _extra_state object -> TE's modules beside it that have one too
TE_ONLY_EXTRA_STATE = {
    "self_attention.linear_qkv": (
        "self_attention.core_attention",
        "self_attention.q_layernorm",
        "self_attention.k_layernorm",
    ),
}


def transformer_engine_state_keys(model: torch.nn.Module) -> None:
    """Give ``model`` (local spec) the sharded key set of Transformer Engine's spec."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    local = model.sharded_state_dict

    def sharded_state_dict(*args, **kwargs):
        state = local(*args, **kwargs)
        serialized = torch.frombuffer(bytearray(b"te-extra-state"), dtype=torch.uint8)
        for name, value in list(state.items()):
            for module, te_modules in TE_ONLY_EXTRA_STATE.items():
                if isinstance(value, ShardedObject) and name.endswith(f"{module}._extra_state"):
                    for te_module in te_modules:
                        state[name.replace(module, te_module)] = dataclasses.replace(
                            value, key=value.key.replace(module, te_module), data=serialized
                        )
        if "decoder.final_layernorm.weight" in state:
            norm = state["decoder.final_layernorm.weight"]
            state["decoder.final_layernorm._extra_state"] = ShardedObject(
                "decoder.final_layernorm._extra_state", serialized, (1,), (0,), replica_id=norm.replica_id
            )
        return state

    model.sharded_state_dict = sharded_state_dict


def convert_with_layer_spec(transformer_engine: bool, direction: str, *args) -> None:
    """One rank of a real conversion, its model built with TE's key set or the local spec's."""
    from stapo_megatron.checkpoint import convert

    if transformer_engine:
        build = convert.build_stage

        def build_stage(*a, **k):
            model = build(*a, **k)
            transformer_engine_state_keys(model)
            return model

        convert.build_stage = build_stage
    (hf_to_megatron_rank if direction == "hf_to_megatron" else megatron_to_hf_rank)(*args)


def test_a_checkpoint_of_either_layer_spec_converts_back_with_the_other(tmp_path, monkeypatch):
    from stapo_megatron.checkpoint import convert

    hf_dir = save_tiny_qwen3(tmp_path / "hf", tie=False, seed=4, num_hidden_layers=2)
    reference = load_file(hf_dir / "model.safetensors")
    tp, pp = 2, 1
    for writer_te, reader_te in ((False, True), (True, False)):
        name = f"{'te' if writer_te else 'local'}-to-{'te' if reader_te else 'local'}"
        ckpt = tmp_path / name / "megatron"

        # the real conversions, each rank's model built with the wanted spec's key set
        monkeypatch.setattr(convert, "hf_to_megatron_rank", _Picklable(writer_te, "hf_to_megatron"))
        monkeypatch.setattr(convert, "megatron_to_hf_rank", _Picklable(reader_te, "megatron_to_hf"))
        convert_hf_to_megatron(hf_dir, ckpt, tp=tp, pp=pp)
        # no module's _extra_state in the checkpoint, whichever spec wrote it
        keys = read_dcp_metadata(ckpt / METADATA_FILE).state_dict_metadata
        assert any("layer_norm_weight" in key for key in keys), name
        assert not [key for key in keys if "_extra_state" in key], name
        out = convert_megatron_to_hf(ckpt, tmp_path / name / "hf", tp=tp, pp=pp)
        converted = {}
        for shard in sorted(out.glob("*.safetensors")):
            converted.update(load_file(shard))
        assert sorted(converted) == sorted(reference), name
        for key, tensor in reference.items():
            assert torch.equal(converted[key], tensor), f"{name}: {key} differs"


@dataclasses.dataclass(frozen=True)
class _Picklable:
    """A rank function that spawn_ranks can send to its ranks: a conversion rank with one layer spec."""

    transformer_engine: bool
    direction: str

    def __call__(self, *args) -> None:
        convert_with_layer_spec(self.transformer_engine, self.direction, *args)
