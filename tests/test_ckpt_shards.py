"""The sharded tensor format in one process: regions cut into chunks, pieces written by the ranks of one
layout and read back by the ranks of another, only the files a region needs, standard safetensors
files, a gap in the shards refused, and checkpoints of the first format (whole tensors) still read."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tpe_train.ckpt.holdings import Holding
from tpe_train.ckpt.shards import (
    Plan,
    Region,
    ShardError,
    dump_index,
    merge_index,
    read_index,
    read_tensor,
    save_pieces,
    split_range,
)
from tpe_train.ckpt.store import write_manifest

TENSORS = {"w": ((8, 12), 1), "b": ((12,), 0), "t": ((4, 6, 8), 2)}  # name: (shape, tensor-parallel dim)


def test_a_flat_range_is_cut_into_few_rectangular_chunks_in_order() -> None:
    for shape in [(7,), (3, 5), (4, 3, 5), (2, 1, 3, 4)]:
        n = math.prod(shape)
        index = torch.arange(n).view(shape)
        for lo in range(n):
            for hi in range(lo + 1, n + 1):
                chunks = split_range(shape, lo, hi)
                covered = [
                    index[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))].reshape(-1)
                    for (offsets, sizes), _, _ in chunks
                ]
                assert torch.cat(covered).tolist() == list(range(lo, hi)), (shape, lo, hi)
                assert [(a, b) for _, a, b in chunks] == [
                    (a, a + len(c)) for (_, a, _), c in zip(chunks, covered, strict=True)
                ]
                assert len(chunks) <= 2 * len(shape) - 1


def layout(tp: int, dp: int, full: dict[str, torch.Tensor], seed: int) -> dict[int, list[Holding]]:
    """What each rank of a tp x dp layout holds: its tensor-parallel block (along the tensor's dim),
    cut at random points into dp fragments (ZeRO-1/2's flat partitions cut parameters anywhere)."""
    g = torch.Generator().manual_seed(seed)
    ranks: dict[int, list[Holding]] = {}
    for name, tensor in full.items():
        dim = TENSORS[name][1]
        for t in range(tp):
            sizes = list(tensor.shape)
            offsets = [0] * tensor.dim()
            sizes[dim] //= tp
            offsets[dim] = t * sizes[dim]
            block = tensor[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))].reshape(-1)
            cuts = sorted(torch.randperm(block.numel() - 1, generator=g)[: dp - 1].add(1).tolist())
            bounds = [0, *cuts, block.numel()]
            for d in range(dp):
                region = Region(
                    name, tuple(tensor.shape), tuple(offsets), tuple(sizes), bounds[d], bounds[d + 1]
                )
                ranks.setdefault(d * tp + t, []).append(
                    Holding(region, block[bounds[d] : bounds[d + 1]].clone())
                )
    return ranks


def save(directory: Path, ranks: dict[int, list[Holding]]) -> dict:
    parts = [
        save_pieces(directory, f"model-{rank:05d}", [h.piece() for h in held])[0]
        for rank, held in ranks.items()
    ]
    return merge_index(parts)


@pytest.fixture
def full() -> dict[str, torch.Tensor]:
    return {name: torch.randn(shape) for name, (shape, _) in TENSORS.items()}


def test_pieces_written_by_one_layout_are_read_back_by_any_other_bitwise(tmp_path: Path, full: dict) -> None:
    index = save(tmp_path, layout(tp=2, dp=3, full=full, seed=1))
    for name, tensor in full.items():
        assert torch.equal(read_tensor(tmp_path, index, name), tensor)  # one tensor, whole (offline)
    for tp, dp in [(4, 2), (1, 5), (1, 1), (2, 3)]:
        for held in layout(tp, dp, full, seed=7).values():
            for h in held:
                got = torch.full_like(h.data, float("nan"))
                Plan(tmp_path, index, [(h.region, got)]).run()
                assert torch.equal(got, h.data), (tp, dp, h.region)


def test_replicas_share_the_writing_and_every_element_is_written_once(tmp_path: Path, full: dict) -> None:
    """Ranks that hold the same state alike (no ZeRO, or a tensor TP does not split) each write a part."""
    ranks = {
        r: [Holding(Region.whole(n, tuple(t.shape)), t.reshape(-1), 3, r) for n, t in full.items()]
        for r in range(3)
    }
    index = save(tmp_path, ranks)
    for name, tensor in full.items():
        chunks = index["tensors"][name]["chunks"]
        assert sum(math.prod(c["sizes"]) for c in chunks) == tensor.numel()  # no element twice
        assert {c["file"] for c in chunks} == {f"model-{r:05d}.safetensors" for r in range(3)}
        assert torch.equal(read_tensor(tmp_path, index, name), tensor)


def test_a_rank_reads_only_the_files_holding_its_region(tmp_path: Path, full: dict) -> None:
    index = save(tmp_path, layout(tp=2, dp=1, full=full, seed=3))  # rank t holds block t of every tensor
    for rank, held in layout(tp=2, dp=1, full=full, seed=3).items():
        plan = Plan(tmp_path, index, [(h.region, torch.empty(h.region.numel)) for h in held])
        assert plan.files == [f"model-{rank:05d}.safetensors"]


def test_the_files_are_plain_safetensors(tmp_path: Path, full: dict) -> None:
    index = save(tmp_path, layout(tp=2, dp=2, full=full, seed=5))
    loaded = {}
    for rank in range(4):
        loaded.update(load_file(str(tmp_path / f"model-{rank:05d}.safetensors")))
    for name, entry in index["tensors"].items():
        for chunk in entry["chunks"]:
            box = tuple(slice(o, o + s) for o, s in zip(chunk["offsets"], chunk["sizes"], strict=True))
            assert torch.equal(loaded[chunk["key"]], full[name][box])


def test_a_region_the_shards_do_not_cover_is_refused(tmp_path: Path, full: dict) -> None:
    ranks = layout(tp=1, dp=2, full=full, seed=2)
    index = save(tmp_path, {0: ranks[0]})  # rank 1's pieces never written
    with pytest.raises(ShardError, match=r"do not cover w\[.*the checkpoint is incomplete"):
        read_tensor(tmp_path, index, "w")
    bigger = Region.whole("w", (8, 13))
    with pytest.raises(ShardError, match=r"has shape .* another model"):
        Plan(tmp_path, index, [(bigger, torch.empty(bigger.numel))])


def test_a_checkpoint_of_the_first_format_is_read_as_whole_tensors(tmp_path: Path, full: dict) -> None:
    save_file({"w": full["w"], "b": full["b"]}, str(tmp_path / "model.safetensors"))
    save_file({"exp_avg/w": full["w"] * 2}, str(tmp_path / "optimizer.safetensors"))
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "tpe-train-checkpoint/1", "files": {}}))
    index = read_index(tmp_path)
    assert set(index["tensors"]) == {"w", "b", "exp_avg/w"}
    region = Region("w", (8, 12), (0, 6), (8, 6), 5, 40)  # a TP=2 rank's ZeRO fragment of it
    got = torch.empty(region.numel)
    Plan(tmp_path, index, [(region, got)]).run()
    assert torch.equal(got, full["w"][:, 6:].reshape(-1)[5:40])
    assert torch.equal(read_tensor(tmp_path, index, "exp_avg/w"), full["w"] * 2)


def test_a_written_directory_appears_only_complete_and_a_failure_keeps_the_old_one(tmp_path: Path) -> None:
    from tpe_train.run.outputs import MARKER, written_directory

    out = tmp_path / "export"
    with written_directory(out, "test", "export") as tmp:
        (tmp / "a").write_text("1")
        assert not out.exists()  # nothing at the final name while it is written
    assert (out / "a").read_text() == "1"
    with pytest.raises(RuntimeError), written_directory(out, "test", "export") as tmp:
        (tmp / "a").write_text("2")
        raise RuntimeError("interrupted")
    assert (out / "a").read_text() == "1"  # the previous one stands
    with written_directory(out, "test", "export") as tmp:
        (tmp / "b").write_text("3")
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "b"]  # replaced whole, not merged
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # no temporary or old copies left


def test_a_zero_dimensional_tensor_is_written_and_read_back(tmp_path: Path) -> None:
    """A scalar parameter (a learned gain, as an encoding of the user's own package may hold)."""
    gain = torch.tensor(1.25)
    held = [Holding(Region.whole("gain", ()), gain.reshape(-1))]
    index = save(tmp_path, {0: held})
    got = read_tensor(tmp_path, index, "gain")
    assert got.shape == () and torch.equal(got, gain)


@pytest.mark.parametrize(("tp", "dp"), [(2, 3), (1, 4), (4, 1)])
def test_the_index_of_any_layout_passes_the_check_against_its_files(
    tmp_path: Path, full: dict, tp: int, dp: int
) -> None:
    """Many chunks per tensor (ZeRO fragments of tensor-parallel blocks) in many files, and a scalar:
    every chunk agrees with its file's header; an index giving another dtype is refused."""
    ranks = layout(tp=tp, dp=dp, full=full, seed=11)
    ranks[0].append(Holding(Region.whole("gain", ()), torch.tensor([1.25])))
    index = save(tmp_path, ranks)
    (tmp_path / "index.json").write_text(dump_index(index))
    write_manifest(tmp_path, 1, {}, {})
    assert read_index(tmp_path) == json.loads(dump_index(index))
    for name, tensor in full.items():
        assert torch.equal(read_tensor(tmp_path, index, name), tensor)
    index["dtype"] = "F64"  # what the files hold is F32
    (tmp_path / "index.json").write_text(dump_index(index))
    write_manifest(tmp_path, 1, {}, {})
    with pytest.raises(
        ShardError, match=r"model-00000.safetensors: tensor .* is F32, .*index.json gives F64"
    ):
        read_index(tmp_path)
