"""Pure pieces of the checkpoint: owned ranges, flat ranges as boxes, files checked, metadata unpickled safely."""
import hashlib
import math
import os
import pickle

import pytest
import torch
import torch.nn as nn

from pretrain.checkpoint.read import read_dcp_metadata, read_json, verify_file
from pretrain.errors import CheckpointError
from pretrain.checkpoint.tensors import flat_index, flat_range_boxes, is_main_replica
from zero3d.flat import FlatLayout
from zero3d.sharded_state import owned_pieces


@pytest.mark.parametrize("bucket_elements", [1, 10, 1000])
@pytest.mark.parametrize("dp", [1, 2, 3, 4, 7])
def test_owned_pieces_cover_every_element_once(dp, bucket_elements):
    params = [("a", nn.Parameter(torch.zeros(5, 3))), ("b", nn.Parameter(torch.zeros(4))),
              ("c", nn.Parameter(torch.zeros(2, 3, 2)))]
    layout = FlatLayout(params, dp, bucket_elements)
    seen = {slot.name: torch.zeros(slot.numel, dtype=torch.int) for slot in layout.slots}
    for rank in range(dp):
        ranges = owned_pieces(layout, rank)
        assert len({slot.name for slot, *_ in ranges}) == len(ranges)  # at most one range a parameter
        flat = torch.arange(layout.padded_numel)
        shard = layout.shard_of(flat, rank)  # the rank's shard: its bucket pieces, concatenated
        for slot, lo, hi, shard_lo in ranges:
            # element j of the range sits at shard_lo + j in the shard and at slot.start + lo + j in flat
            assert torch.equal(shard[shard_lo:shard_lo + hi - lo], flat[slot.start + lo:slot.start + hi])
            assert 0 <= shard_lo and shard_lo + hi - lo <= layout.shard_numel
            seen[slot.name][lo:hi] += 1
    assert all(bool((count == 1).all()) for count in seen.values())


@pytest.mark.parametrize("shape", [(7,), (4, 5), (3, 4, 5)])
def test_flat_range_boxes_are_the_range_in_order(shape):
    n = math.prod(shape)
    full = torch.arange(n).view(shape)
    for lo in range(n):
        for hi in range(lo + 1, n + 1):
            boxes = flat_range_boxes(shape, lo, hi)
            assert len(boxes) <= 2 * len(shape) - 1
            got = torch.cat([full[tuple(slice(o, o + s) for o, s in zip(off, size))].reshape(-1)
                             for off, size in boxes])
            assert torch.equal(got, torch.arange(lo, hi)), (lo, hi, boxes)
            assert flat_index(shape, boxes[0][0]) == lo


def test_main_replica_ignores_the_dp_coordinate():
    assert is_main_replica((0, 0, 3)) and not is_main_replica((0, 1, 0)) and not is_main_replica((1, 0, 0))
    assert is_main_replica(0) and not is_main_replica(2)


class RunsShell:
    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def test_crafted_metadata_is_refused_without_running(tmp_path):
    marker = tmp_path / "pwned"
    (tmp_path / ".metadata").write_bytes(pickle.dumps({"x": RunsShell(f"touch {marker}")}))
    with pytest.raises(CheckpointError) as err:
        read_dcp_metadata(tmp_path)
    assert str(err.value) == (f"{tmp_path}/.metadata asks to load posix.system, which is not part of DCP's "
                              "checkpoint metadata; refusing to unpickle it")
    assert not marker.exists()


def test_dcp_metadata_round_trips_through_the_restricted_unpickler(tmp_path):
    import torch.distributed.checkpoint as dcp
    dcp.save({"w": torch.arange(6.0).view(2, 3)}, checkpoint_id=tmp_path, no_dist=True)
    md = read_dcp_metadata(tmp_path)
    assert tuple(md.state_dict_metadata["w"].size) == (2, 3)


def test_malformed_and_missing_files_are_named(tmp_path):
    with pytest.raises(CheckpointError, match=f"^{tmp_path}/checkpoint.json is missing$"):
        read_json(tmp_path / "checkpoint.json")
    (tmp_path / "checkpoint.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="is malformed: expected a JSON object, found list"):
        read_json(tmp_path / "checkpoint.json")
    with pytest.raises(CheckpointError, match=f"^{tmp_path}/.metadata is malformed: UnpicklingError"):
        (tmp_path / ".metadata").write_bytes(b"not a pickle")
        read_dcp_metadata(tmp_path)


def test_verify_file_tells_missing_truncated_and_tampered(tmp_path):
    data = b"0123456789"
    record = {"bytes": 10, "sha256": hashlib.sha256(data).hexdigest()}
    assert verify_file(tmp_path, "part", record) == f"{tmp_path}/part is missing"
    (tmp_path / "part").write_bytes(data)
    assert verify_file(tmp_path, "part", record) == ""
    (tmp_path / "part").write_bytes(data[:4])
    assert verify_file(tmp_path, "part", record) == (
        f"{tmp_path}/part has 4 bytes, the manifest records 10 (truncated or replaced)")
    (tmp_path / "part").write_bytes(b"0123456780")
    assert verify_file(tmp_path, "part", record) == (
        f"{tmp_path}/part does not match its SHA-256 in checkpoint.json (corrupted or tampered)")
