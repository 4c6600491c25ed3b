"""The `shards` option's parsing and decision (service/frontend/decode_request.py) and the `auto` rule
(service/frontend/shard_option.py): pure functions, no server."""
from __future__ import annotations

import pytest

from service.frontend import decode_request, shard_option
from service.problems import Problem
from service.settings import Settings


@pytest.mark.parametrize("value,want", [(None, 1), ("", 1), ("1", 1), ("4", 4), (2, 2), ("auto", "auto"),
                                        (" AUTO ", "auto"), (3.0, 3)])
def test_parse_accepts_auto_and_whole_numbers(value, want):
    assert decode_request.parse_shards(value) == want


@pytest.mark.parametrize("value", ["0", "-1", "65", "2.5", 2.5, "x", True, [2]])
def test_parse_refuses_the_rest_with_a_422(value):
    with pytest.raises(Problem) as e:
        decode_request.parse_shards(value)
    assert e.value.status == 422 and e.value.kind == "bad-shards"


def test_auto_follows_the_measured_rows_and_the_device_count():
    image, video = shard_option.SD_LAYOUT, shard_option.WAN21
    px4k, px480, px720 = 4096 * 4096, 81 * 480 * 832, 121 * 720 * 1280
    assert shard_option.auto_shards(image, px4k - 1, 8) == 1
    assert shard_option.auto_shards(image, px4k, 8) == 4   # the most devices a row names
    assert shard_option.auto_shards(image, px4k, 3) == 2   # never more than the server has
    assert shard_option.auto_shards(image, px4k, 1) == 1
    assert shard_option.auto_shards(video, px480, 4) == 4
    assert shard_option.auto_shards(video, px480, 3) == 2  # no row names 3: the most one names below it
    assert shard_option.auto_shards(video, px480 - 1, 4) == 1  # below every video row
    assert shard_option.auto_shards(video, px720, 2) == 2
    assert shard_option.auto_shards(None, 10 * px720, 8) == 1  # a family without a sharded decode
    # the 2026 families from the sizes they were measured at; a count no row names is never chosen
    assert shard_option.auto_shards("wan2.2", 121 * 704 * 1280, 4) == 4
    assert shard_option.auto_shards("wan2.2", px480, 4) == 1  # below its measured size: one device
    assert shard_option.auto_shards("flux2", px4k, 4) == 4
    assert shard_option.auto_shards("flux2", px4k, 3) == 2  # no row names 3: the most one names below it
    assert shard_option.auto_shards("qwen-image", px4k, 2) == 2
    assert shard_option.auto_shards("qwen-image", px4k - 1, 2) == 1  # below its measured size
    assert shard_option.auto_shards("qwen-image", px4k - 1, 4) == 1
    assert all(r.evidence for r in shard_option.AUTO_RULES)
    # a rule names a family the models know, or it would never apply (a typo is not a rule)
    from models.sharding import declared
    assert {r.family for r in shard_option.AUTO_RULES} <= {f.name for f in declared().values()}


class Hm:
    """What decide_shards reads of a served model: its name, its view's shard family, its output shape."""

    def __init__(self, family=shard_option.SD_LAYOUT):
        self.name, self.model = "m", type("View", (), {"shard_family": family})()

    @staticmethod
    def output_shape(shape):
        return (shape[0], 8 * shape[-2], 8 * shape[-1], 3)


def test_decide_names_what_cannot_be_sharded():
    def kind(requested, family=shard_option.SD_LAYOUT, lat=(1, 4, 9, 13), devices=2, tiled=None):
        try:
            return decode_request.decide_shards(Hm(family), lat, requested, tiled, devices)
        except Problem as e:
            assert e.status == 422
            return e.kind
    assert kind(2) == 2 and kind(1) == 1 and kind("auto") == 1
    assert kind(3) == "too-many-shards"
    assert kind(2, family=None) == "not-shardable"
    assert kind(2, tiled=True) == "tiled-and-sharded"
    assert kind("auto", tiled=True) == 1
    assert kind(2, lat=(1, 4, 1, 13)) == "too-many-shards"
    assert kind(2, family=shard_option.WAN21, lat=(1, 4, 3, 1, 9)) == "too-many-shards"  # rows: axis -2


def test_a_refusal_names_what_the_workers_offer():
    """The front end names the sharded families as its workers' status says them (it imports no
    model code), and its copy of the latents' row axis is the models' own."""
    from models import sharding

    with pytest.raises(Problem, match="m: a sharded decode is offered for the X and Y decoders"):
        decode_request.decide_shards(Hm(None), (1, 4, 9, 13), 2, None, 2, offered="the X and Y decoders")
    assert decode_request.LATENT_ROWS == sharding.LATENT_ROWS


def test_without_shard_groups_auto_is_one_device_and_n_a_501():
    lat = (1, 4, 512, 512)  # 4096x4096: auto would shard it where groups exist
    off = decode_request.groups_off("cuda", Settings(shard_groups=False))
    assert decode_request.decide_shards(Hm(), lat, "auto", None, 4) == 4
    assert decode_request.decide_shards(Hm(), lat, "auto", None, 4, off) == 1
    assert decode_request.decide_shards(Hm(), lat, 1, None, 4, off) == 1
    with pytest.raises(Problem) as e:
        decode_request.decide_shards(Hm(), lat, 2, None, 4, off)
    assert e.value.status == 501 and e.value.kind == "shard-groups-off" and "CONVSERVE_SHARD_GROUPS" in e.value.detail


def test_which_servers_form_shard_groups():
    assert Settings().shard_groups, "on by default"
    assert decode_request.groups_off("cuda", Settings()) is None
    assert decode_request.groups_off("numpy", Settings(shard_groups=False)) is None  # emulated shards
    assert decode_request.groups_off("cuda", Settings(shard_groups=False))[0] == "shard-groups-off"
    # mlx's emulated shards would fail (its streams are per thread); a real communicator is fine
    assert decode_request.groups_off("mlx", Settings())[0] == "shards-not-on-this-backend"
    assert decode_request.groups_off("mlx", Settings(shard_comm="test-gloo")) is None


def test_the_shard_communicator_is_a_closed_choice_not_an_import_string():
    """CONVSERVE_SHARD_COMM names one of two communicators; a "module:Class" string (which the
    workers would import) is refused when the settings are read."""
    import pydantic
    assert Settings().shard_comm == "auto"
    for bad in ("gloo_shards:GlooShards", "os:system", "gloo"):
        with pytest.raises(pydantic.ValidationError):
            Settings(shard_comm=bad)


def test_the_cli_knows_every_sharded_family_by_its_preset():
    """`convserve decode --shards N` refuses a preset with no sharded decode before any GPU work,
    by the preset's family package: every preset whose model decodes sharded passes that check
    (it then needs CUDA), and one without a sharded decode is named as such. (When the families
    became packages, the check compared against the model classes' module names, now all
    `model`, and refused every preset; only a two-GPU test saw it.)"""
    from models import sharding
    from models.registry import PRESETS

    sharded = {p.family for p in PRESETS.values() if p.family in sharding.family_modules()}
    assert sharded == {"autoencoder_kl", "flux2_vae", "qwen_image_vae", "wan_vae", "wan22_vae", "taesd",
                       "hunyuanimage_vae", "qwen_image21_vae", "ltx2_vae", "hunyuanvideo15_vae", "dc_ae"}
    assert "convnext" not in sharding.family_modules()
