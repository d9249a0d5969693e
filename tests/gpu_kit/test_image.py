"""The image manifest: the shipped one loads, and a malformed one is refused with its file named."""
import pytest

from bertdist.config import ConfigError
from bertdist.gpu_kit.image import canonical, load_image

SHIPPED = "configs/images/gpu-node-cuda13-py312.yaml"


def test_the_shipped_manifest_describes_the_gpu_node(repo_root):
    image = load_image(repo_root / SHIPPED)
    assert (image.python, image.python_tag, image.glibc, image.arch) == ("3.12", "cp312", (2, 28), "x86_64")
    assert image.packages["torch"] == "2.11.0" and image.packages["transformers"] == "5.17.0"
    assert image.has("PyYAML") and image.has("typing_extensions")  # normalised names
    for absent in ("deepspeed", "pydantic", "hjson", "apache-beam", "blingfire", "mwparserfromhell"):
        assert not image.has(absent), absent


@pytest.mark.parametrize("change, message", [
    ({"python": "3"}, "is not major.minor"),
    ({"platform": "macosx_14_0_arm64"}, "is not a manylinux tag"),
    ({"missing": ["torch"]}, "listed both as packages and as missing"),
    ({"colour": "blue"}, "unknown key"),
])
def test_a_bad_manifest_is_refused_with_its_file(tmp_path, change, message):
    import yaml

    data = {"name": "site", "python": "3.12", "platform": "manylinux_2_28_x86_64", "packages": {"torch": "2.11.0"},
            **change}
    path = tmp_path / "image.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=message) as e:
        load_image(path)
    assert str(path) in str(e.value)


def test_glibc_of_the_legacy_tags_and_name_normalisation(tmp_path):
    path = tmp_path / "image.yaml"
    path.write_text("name: old\npython: '3.10'\nplatform: manylinux2014_x86_64\npackages: {}\n")
    assert load_image(path).glibc == (2, 17)
    assert canonical("Typing_Extensions") == canonical("typing.extensions") == "typing-extensions"
    with pytest.raises(ConfigError, match="not found"):
        load_image(tmp_path / "nope.yaml")
