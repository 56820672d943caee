"""`python -m rlcore.export`: a tied model's lm_head is written once (the loader re-ties it), and
the export of a run started from a GGUF file is a plain model directory that reloads and saves."""

import json

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from rlcore.models.build import build_model, build_tokenizer
from rlcore.plan.compose import compose
from rlcore.storage import checkpoint as ckpt
from rlcore.storage.export import export_checkpoint, main


def saved_checkpoint(tmp_path):
    """A committed single-process checkpoint of the default tiny (tied) policy."""
    cfg = compose([f"output_dir={tmp_path / 'run'}"])
    assert cfg.model.arch["tie_word_embeddings"]
    tok = build_tokenizer(cfg.model)
    model = build_model(cfg.model, tok)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    from types import SimpleNamespace

    from rlcore.trainer.schedule import build_scheduler

    core = SimpleNamespace(
        model=model,
        optimizer=opt,
        scheduler=build_scheduler(opt, cfg.trainer, 10),
        rank=0,
        world_size=1,
        version=1,
        cfg=cfg,
        tokenizer=tok,
    )
    writer = ckpt.CheckpointWriter(cfg)
    tmp = writer.begin(1)
    parts = ckpt.save_trainer(core, tmp)
    return writer.commit(tmp, 1, {"kind": "rl", "step": 1}, parts), model


def tensor_names(hf_dir):
    with safe_open(str(hf_dir / "model.safetensors"), "pt") as f:
        return set(f.keys())


def test_tied_lm_head_is_written_once_and_reloads(tmp_path):
    path, model = saved_checkpoint(tmp_path)
    out = export_checkpoint(path, tmp_path / "hf")
    names = tensor_names(out)
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()
    ids = torch.tensor([[1, 5, 9, 14]])
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model.eval()(ids).logits)


def test_export_of_a_gguf_started_run_reloads_and_saves_again(tmp_path, capsys):
    path, _ = saved_checkpoint(tmp_path)
    config_json = path / ckpt.HF_DIR / "config.json"  # what a GGUF-loaded model's config carried
    config = json.loads(config_json.read_text())
    config["quantization_config"] = {"quant_method": "gguf"}
    config_json.write_text(json.dumps(config))
    assert main([str(path.parent), str(tmp_path / "hf")]) == 0
    assert "quantization_config" not in json.loads((tmp_path / "hf" / "config.json").read_text())
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    reloaded.save_pretrained(tmp_path / "again")
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "again") is not None


def test_export_into_a_used_folder_is_refused_unless_forced(tmp_path, capsys):
    path, _ = saved_checkpoint(tmp_path)
    out = tmp_path / "hf"
    out.mkdir()
    (out / "notes.txt").write_text("someone's work")
    assert main([str(path), str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not empty" in err[0] and "--force" in err[0], err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]  # untouched
    assert main([str(path), str(out), "--force"]) == 0
    assert (out / "model.safetensors").is_file() and not (out / "notes.txt").exists()
    assert main([str(path), str(tmp_path / "empty_or_new")]) == 0
