"""build_batch: the step's flattened tensors."""

from __future__ import annotations

import torch

from sluice_server.batch import RequestState, Work, build_batch
from sluice_server.pb import shard_pb2

BS = 16


def work(rid: int, length: int, new: int, blocks: list[int], slot: int = 0) -> Work:
    """Request rid holding `length` tokens, `new` of them computed by this step."""
    state = RequestState(id=rid, token_ids=[100 + rid * 1000 + i for i in range(length)], num_prompt_tokens=length - new,
                         num_computed_tokens=length - new, block_ids=blocks, params=shard_pb2.SamplingParams(),
                         adapter_slot=slot)
    return Work(state, length - new, new, blocks)


def test_decodes_alone_get_the_rows_they_get_beside_a_prompt():
    """A step of decodes only takes a shorter way to positions and slots; each
    decode's row must be the one the general way gives it in a mixed step."""
    decodes = [work(0, 40, 1, [7, 3, 9]), work(1, 16, 1, [2]), work(2, 17, 1, [5, 11], slot=1), work(3, 1, 1, [4])]
    prompt = work(9, 30, 20, [6, 8])
    alone = build_batch(decodes, BS, torch.device("cpu"))
    mixed = build_batch([prompt, *decodes], BS, torch.device("cpu"))
    n = len(decodes)
    assert [w.state.id for w in alone.work] == [w.state.id for w in mixed.work[:n]]  # decodes first, by slot
    assert alone.positions.tolist() == mixed.positions[:n].tolist() == [w.start for w in alone.work]
    assert alone.attn.slot_mapping.tolist() == mixed.attn.slot_mapping[:n].tolist()
    assert alone.input_ids.tolist() == mixed.input_ids[:n].tolist()
    assert alone.attn.query_start_loc.tolist() == mixed.attn.query_start_loc[: n + 1].tolist() == list(range(n + 1))
    assert alone.attn.seq_lens.tolist() == mixed.attn.seq_lens[:n].tolist()
    assert alone.logits_indices.tolist() == list(range(n)) and alone.logits_rows == mixed.logits_rows[:n]
    for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
        assert getattr(alone.attn, name).dtype == getattr(mixed.attn, name).dtype == torch.int64, name
    assert alone.positions.dtype == torch.int64
    # Position 39 of request 0 sits in its third block (9), slot 7; request 1's 16th token in block 2's last slot.
    by_id = {w.state.id: i for i, w in enumerate(alone.work)}
    assert alone.attn.slot_mapping[by_id[0]].item() == 9 * BS + 7
    assert alone.attn.slot_mapping[by_id[1]].item() == 2 * BS + 15
    assert alone.lora is not None and alone.lora.starts == [n - 1]  # the slot-1 decode sorts last
