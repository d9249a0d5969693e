"""A wheel goes into the kit only if it installs on the image's CPython and glibc."""
from pathlib import Path

import pytest

from bertdist.gpu_kit.image import ImageManifest
from bertdist.gpu_kit.wheels import platform_tags, wheel_fits

IMAGE = ImageManifest(name="node", python="3.12", platform="manylinux_2_28_x86_64", packages={})


@pytest.mark.parametrize("name, fits", [
    ("deepspeed-0.19.8-py3-none-any.whl", True),
    ("pydantic_core-2.50.4-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl", True),
    ("pydantic_core-2.50.4-cp311-cp311-manylinux_2_17_x86_64.whl", False),  # another Python
    ("cryptography-50.0.2-cp38-abi3-manylinux_2_28_x86_64.whl", True),  # the stable ABI, older minor
    ("cryptography-50.0.2-cp313-abi3-manylinux_2_28_x86_64.whl", False),  # needs a newer Python
    ("numpy-2.5.2-cp312-cp312-manylinux_2_34_x86_64.whl", False),  # newer glibc than the image's
    ("numpy-2.5.2-cp312-cp312-manylinux_2_28_aarch64.whl", False),
    ("numpy-2.5.2-cp312-cp312-macosx_14_0_arm64.whl", False),
    ("legacy-1.0-py2.py3-none-any.whl", True),
])
def test_wheel_tags_against_the_image(name, fits):
    assert wheel_fits(Path(name), IMAGE) is fits


def test_pip_is_offered_every_manylinux_tag_up_to_the_image_glibc():
    tags = platform_tags(IMAGE)
    assert tags[0] == "manylinux_2_28_x86_64" and "manylinux_2_17_x86_64" in tags and "manylinux2014_x86_64" in tags
    assert "manylinux_2_29_x86_64" not in tags and all(t.endswith("x86_64") for t in tags)
