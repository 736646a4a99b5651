"""``seqpar verify --model``: a local checkpoint directory passes at P=2 and prints its per-group
differences (built-in names run the same engine, see test_hf.py); bad names fail with one clear
line (exit 2); build_model's built-ins."""

import pytest
import torch

from seqpar.cli.main import main
from seqpar.integrations.models import BUILTIN_MODELS, build_model


@pytest.mark.distributed
def test_verify_local_checkpoint(tmp_path, capsys):
    torch.manual_seed(0)
    model, _ = build_model("tiny-mistral")
    model.save_pretrained(tmp_path)
    assert main(["verify", "--model", str(tmp_path), "--nproc", "2"]) == 0
    out = capsys.readouterr().out
    assert "3 passed, 0 failed" in out  # padded, packed, plain (head overrides are for built-ins)
    for column in ("loss", "attention", "embed", "lm_head", "mlp", "norm"):
        assert column in out


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["tiny-gpt7", "/no/such/dir"])
def test_verify_unknown_model_is_one_clear_error(name, capsys):
    assert main(["verify", "--model", name, "--nproc", "2"]) == 2
    err = capsys.readouterr().err
    assert name in err and all(b in err for b in BUILTIN_MODELS)


def test_build_model_builtins_and_errors():
    for name in BUILTIN_MODELS:
        model, tok = build_model(name, dtype=torch.float64, num_hidden_layers=1)
        assert tok is None and model.config.num_hidden_layers == 1
        assert next(model.parameters()).dtype == torch.float64
    assert build_model("tiny-gemma2")[0].config._attn_implementation == "eager"  # sdpa refuses softcap
    assert build_model("tiny-llama", attn_implementation="eager")[0].config._attn_implementation == "eager"
    with pytest.raises(ValueError, match="tiny-llama"):
        build_model("llama-7b")


@pytest.mark.distributed
def test_verify_checkpoint_of_a_zoo_family(tmp_path, capsys):
    """A local GPT-OSS checkpoint (attention sinks, MoE, its own eager attention) passes; a BART
    one (positions seqpar cannot feed) is reported refused with the reason, exit 1."""
    from seqpar.testing.zoo import build_tiny

    build_tiny("gpt_oss").save_pretrained(tmp_path / "gpt_oss")
    assert main(["verify", "--model", str(tmp_path / "gpt_oss"), "--nproc", "2"]) == 0
    assert "3 passed, 0 failed" in capsys.readouterr().out
    build_tiny("bart").save_pretrained(tmp_path / "bart")
    assert main(["verify", "--model", str(tmp_path / "bart"), "--nproc", "2"]) == 1
    out = capsys.readouterr().out
    assert "REFUSED" in out and "takes no position_ids" in out
