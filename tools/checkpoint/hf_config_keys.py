"""Reading a HuggingFace config.json: a required key, a refused feature, the RoPE base; shared
by the dense (hf_import.py) and the MoE (hf_moe_configs.py) architectures."""

from __future__ import annotations

from tools.checkpoint.model_state import ConversionError


def required(hf_config: dict, key: str, source: str):
    if hf_config.get(key) is None:
        raise ConversionError(f"{source}: no '{key}'; the config is incomplete")
    return hf_config[key]


def refuse(source: str, what: str, why: str) -> None:
    raise ConversionError(f"{source}: {what}, which our GPTModel does not compute ({why})")


def rope_parameters(hf_config: dict) -> dict:
    """transformers 5's rope_parameters, or the 4.x rope_scaling + rope_theta keys."""
    parameters = dict(hf_config.get("rope_parameters") or {})
    parameters.update(hf_config.get("rope_scaling") or {})
    parameters.setdefault("rope_theta", hf_config.get("rope_theta", 10000.0))
    return parameters


def rope_theta(hf_config: dict, source: str, *, scaled: tuple[str, ...] = ()) -> int:
    """The integer RoPE base; a scaling type other than default (and `scaled`) is refused."""
    parameters = rope_parameters(hf_config)
    kind = parameters.get("rope_type", parameters.get("type", "default"))
    if kind not in ("default", *scaled):
        refuse(
            source,
            f"rope scaling {parameters}",
            f"plain RoPE{' or ' if scaled else ''}{' or '.join(scaled)} only",
        )
    theta = float(parameters["rope_theta"])
    if not theta.is_integer():
        refuse(source, f"rope_theta {theta}", "--rotary-base is an integer")
    return int(theta)
