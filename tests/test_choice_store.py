"""inferflow/native/choices.py: kernel choices kept on disk between processes, one file per GPU and software stack
(the stamp), merged with other processes' entries, ignored when damaged or switched off. CPU only: the GPU's name
and versions are stubbed."""
import json

import pytest
import torch

from inferflow.native import choices

CUDA0 = torch.device("cuda", 0)  # never touched: only its type and index are read


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("INFERFLOW_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(choices.ChoiceStore, "_stamp", lambda self, idx: f"stamp{idx}")
    return lambda: choices.ChoiceStore("demo", [])


def test_a_choice_outlives_its_process(store, tmp_path):
    first = store()
    assert first.get((1, 4096, torch.bfloat16), CUDA0) is choices.MISSING
    first.put((1, 4096, torch.bfloat16), CUDA0, {"block_n": 4})
    first.put((2, 4096, torch.bfloat16), CUDA0, None)
    again = store()  # the next process
    assert again.get((1, 4096, torch.bfloat16), CUDA0) == {"block_n": 4}
    assert again.get((2, 4096, torch.bfloat16), CUDA0) is None  # "cuBLAS" is a choice too, not a miss
    assert again.get((1, 4096, torch.float16), CUDA0) is choices.MISSING
    f = tmp_path / "choices" / "demo-stamp0.json"
    assert json.loads(f.read_text())["(1, 4096, torch.bfloat16)"] == {"block_n": 4}
    assert [p.name for p in f.parent.iterdir()] == [f.name]  # written atomically: no temporary left


def test_entries_of_another_process_are_merged_not_lost(store):
    a, b = store(), store()
    a.get((1,), CUDA0), b.get((1,), CUDA0)  # both read the (empty) file first
    a.put((1,), CUDA0, "a")
    b.put((2,), CUDA0, "b")
    c = store()
    assert c.get((1,), CUDA0) == "a" and c.get((2,), CUDA0) == "b"


def test_another_gpu_or_stack_has_a_file_of_its_own(store, monkeypatch):
    s = store()
    s.put((1,), CUDA0, "x")
    assert s.get((1,), torch.device("cuda", 1)) is choices.MISSING
    monkeypatch.setattr(choices.ChoiceStore, "_stamp", lambda self, idx: "other-torch")
    assert store().get((1,), CUDA0) is choices.MISSING


def test_damaged_file_is_ignored_and_rewritten(store, tmp_path):
    f = tmp_path / "choices" / "demo-stamp0.json"
    f.parent.mkdir(parents=True)
    f.write_text("{not json")
    s = store()
    assert s.get((1,), CUDA0) is choices.MISSING
    s.put((1,), CUDA0, 7)
    assert json.loads(f.read_text()) == {"(1,)": 7}


def test_off_for_cpu_tensors_and_when_switched_off(store, monkeypatch, tmp_path):
    s = store()
    s.put((1,), torch.device("cpu"), 1)
    assert s.get((1,), torch.device("cpu")) is choices.MISSING
    monkeypatch.setenv("INFERFLOW_CHOICE_CACHE", "0")
    s.put((1,), CUDA0, 1)
    assert s.get((1,), CUDA0) is choices.MISSING and not (tmp_path / "choices").exists()


def test_stamp_covers_the_sources(tmp_path, monkeypatch):
    """The real stamp: the GPU's name and capability, the versions and the sources' bytes (GPU facts stubbed)."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda idx: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda idx: (9, 0))
    src = tmp_path / "kernel.cu"
    src.write_text("v1")
    s1 = choices.ChoiceStore("demo", [src])._stamp(0)
    src.write_text("v2")
    assert choices.ChoiceStore("demo", [src])._stamp(0) != s1
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda idx: (8, 0))
    src.write_text("v1")
    assert choices.ChoiceStore("demo", [src])._stamp(0) != s1


def test_read_only_cache_keeps_choices_in_memory_and_warns_once(store, tmp_path, caplog):
    (tmp_path / "choices").write_text("a file where the folder should be")  # mkdir fails: nothing can be written
    s = store()
    with caplog.at_level("WARNING", logger="inferflow.native.choices"):
        s.put((1,), CUDA0, "a")
        s.put((2,), CUDA0, "b")
    assert s.get((1,), CUDA0) == "a" and s.get((2,), CUDA0) == "b"  # this process still has them
    assert len([r for r in caplog.records if "not written" in r.message]) == 1
