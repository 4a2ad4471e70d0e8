"""``partition.piece_views`` (where each rank's piece goes in the full tensor, written in place by the weight sync's
shared-memory TP gather) against ``split_tensor`` / ``merge_tensors`` for every split kind, 2 and 4 ranks."""
import pytest
import torch

from megatron_rl.convert.partition import merge_tensors, piece_views, split_tensor

SHAPES = {"column": (8, 6), "vocab": (16, 6), "row": (6, 8), "expert_row": (6, 8), "glu_column": (16, 6),
          "expert_glu_column": (16, 6)}


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("kind", sorted(SHAPES))
def test_pieces_written_into_their_views_make_the_full_tensor(kind, size):
    full = torch.arange(torch.Size(SHAPES[kind]).numel(), dtype=torch.float32).view(SHAPES[kind])
    pieces = [split_tensor(full, kind, r, size, "w") for r in range(size)]
    got = torch.full_like(full, -1.0)
    for views, piece in zip(piece_views(got, kind, size), pieces):
        for dst, src in zip(views, piece.chunk(len(views), 0)):
            dst.copy_(src)
    assert torch.equal(got, full) and torch.equal(got, merge_tensors(pieces, kind, "w"))


def test_glu_bias_and_unsplit_kind():
    full = torch.arange(8.0)  # a 1-D GLU bias: the gate and up halves, each split
    pieces = [split_tensor(full, "glu_column", r, 2, "b") for r in range(2)]
    got = torch.zeros(8)
    for views, piece in zip(piece_views(got, "glu_column", 2), pieces):
        for dst, src in zip(views, piece.chunk(2, 0)):
            dst.copy_(src)
    assert torch.equal(got, full)
    with pytest.raises(ValueError, match="replicated"):
        piece_views(full, "replicated", 2)
