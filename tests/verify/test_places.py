"""Places of a value's elements in a source, when equal elements (zeros) lie at several places."""
import torch

from scalify.verify.places import affine_places


def _ids_with_a_zero_row() -> torch.Tensor:
    """Distinct ids over [s, b, h, d] but the first sequence row, all one id (x * sin(0))."""
    ids = torch.arange(100, 100 + 8 * 2 * 4 * 8).reshape(8, 2, 4, 8)
    ids[0] = 1
    return ids


def test_a_layout_whose_repeated_elements_have_many_places_is_found():
    ranks = [_ids_with_a_zero_row(), _ids_with_a_zero_row() + 10_000]
    for rank in ranks:
        rank[0] = 1
    source = torch.cat([r.reshape(-1) for r in ranks])
    # the reference's [b, h, s, d]: heads of rank 0 then of rank 1
    value = torch.cat([r.permute(1, 2, 0, 3) for r in ranks], dim=1)
    places = affine_places(value, source)
    assert places is not None
    assert torch.equal(source[places], value)
    stacked = torch.arange(source.numel()).reshape(2, 8, 2, 4, 8)
    assert torch.equal(places, stacked.permute(2, 0, 3, 1, 4).reshape(2, 8, 8, 8))


def test_an_element_no_place_holds_gives_none():
    source = torch.arange(16)
    value = torch.arange(16).reshape(4, 4)
    value[2, 3] = 99
    assert affine_places(value, source) is None


def test_places_whose_steps_differ_from_line_to_line_give_none():
    assert affine_places(torch.tensor([[0, 1], [2, 4]]), torch.arange(6)) is None


def test_a_value_of_one_repeated_element_has_no_step_to_read():
    assert affine_places(torch.ones(3, dtype=torch.int64), torch.ones(5, dtype=torch.int64)) is None
