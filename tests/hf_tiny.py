"""Tiny configs for every text-model architecture of the installed transformers.

The list is generated, not picked: every ``model_type`` of transformers' auto mappings
for causal, seq2seq and masked language modelling, the class ``ssdtrain estimate``
builds for it (``estimate.models._hf_class``: causal LM first, then seq2seq LM, masked LM).
An architecture that is not text (vision, audio, multimodal, by
``ssdtrain.estimate.non_text_inputs``, the rule the CLI refuses them by) is left out
(``tiny_config`` raises :class:`NotText`). Each config is the architecture's defaults with
its sizes shrunk by one generic rule (:data:`SIZES`): 2 layers, hidden size 32, 2
heads, a 256-token vocabulary, 4 experts. Per-layer lists (``layer_types``) are cut
to the new number of layers; token ids are moved inside the vocabulary.
"""

from __future__ import annotations

SIZES = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
    intermediate_size=64, vocab_size=256, head_dim=16, max_position_embeddings=64,
    moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4,
    num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
    d_model=32, d_ff=64, d_kv=16, num_layers=2, num_heads=2, num_decoder_layers=2,
    encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
    decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, ffn_dim=64,
    n_embd=32, n_layer=2, n_head=2, n_inner=64, embedding_size=32,
)
TOKEN_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=0,
                 sep_token_id=2, cls_token_id=1, mask_token_id=3, unk_token_id=3)
LAYER_COUNTS = ("num_hidden_layers", "num_layers", "n_layer")


class NotText(Exception):
    """The architecture is not a text model (``non_text_inputs``)."""


def architectures():
    """``{model_type: class name}`` over transformers' LM auto mappings (causal LM
    first, then seq2seq, then masked LM), sorted by model type."""
    from transformers.models.auto import modeling_auto as ma
    out = {}
    for mapping in (ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                    ma.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
                    ma.MODEL_FOR_MASKED_LM_MAPPING_NAMES):
        for model_type, cls in mapping.items():
            out.setdefault(model_type, cls)
    return dict(sorted(out.items()))


def tiny_config(model_type, class_name):
    """The architecture's default config with :data:`SIZES` applied (``NotText`` for a
    model that is not text; whatever the config class raises if it refuses)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from ssdtrain.estimate import non_text_inputs
    cls = CONFIG_MAPPING[model_type]
    model_cls = getattr(transformers, class_name, None)
    other = None if model_cls is None else non_text_inputs(model_cls, cls)
    if other is not None:
        raise NotText(f"{class_name} is a {other[0]} model (inputs {', '.join(other[1])})")
    defaults = cls().to_dict()
    kw = {k: v for k, v in SIZES.items() if k in defaults}
    layers = next((defaults[k] for k in LAYER_COUNTS if isinstance(defaults.get(k), int)), None)
    for k, v in defaults.items():  # per-layer lists follow the new number of layers
        if layers and isinstance(v, list) and len(v) == layers and k not in kw:
            kw[k] = v[:2]
    for k, v in TOKEN_IDS.items():
        if k in defaults or k == "decoder_start_token_id":
            kw[k] = v
    cfg = cls(**kw)
    cfg.architectures = [class_name]
    return cfg
