"""What the kit ships: the GPU paths' requirements the image lacks, markers read for the target."""
import pytest

from bertdist.gpu_kit.image import ImageManifest, load_image
from bertdist.gpu_kit.requirements import read_lock, resolve

GRAPH = {
    "deepspeed": ["torch", "pydantic>=2", "hjson", "py-cpuinfo", "backport; python_version < '3.12'",
                  "docs-theme; extra == 'docs'"],
    "pydantic": ["pydantic-core==2.50.4", "typing-extensions>=4.6"],
    "pydantic-core": ["typing-extensions"],
    "hjson": [], "backport": [],
}


def _image(python="3.12", packages=("torch", "typing-extensions", "py-cpuinfo", "numpy")) -> ImageManifest:
    return ImageManifest(name="test", python=python, platform="manylinux_2_28_x86_64",
                         packages={p: "1" for p in packages})


def _resolve(image, lock=None, roots=("torch", "deepspeed", "numpy")):
    lock = {"pydantic": "2.14.3", "pydantic-core": "2.50.4", "hjson": "3.1.0", "backport": "1.0"} if lock is None else lock
    return {n.name: n for n in resolve(image, lock, roots=roots, requires=lambda d: GRAPH[d],
                                       version_of=lambda d: {"deepspeed": "0.19.8"}.get(d))}


def test_the_walk_stops_at_the_image_and_reads_markers_for_the_target_python():
    got = _resolve(_image("3.12"))
    assert set(got) == {"deepspeed", "pydantic", "pydantic-core", "hjson"}  # no torch, numpy, backport, extras
    assert got["pydantic-core"].why == "deepspeed -> pydantic -> pydantic-core"
    assert got["deepspeed"].version_from.startswith("installed") and got["hjson"].version_from == "requirements.lock"
    assert "backport" in _resolve(_image("3.11"))  # python_version < '3.12' holds on the older target


def test_a_requirement_without_a_version_is_an_error_naming_its_chain():
    with pytest.raises(LookupError, match=r"hjson \(needed: deepspeed -> hjson\)"):
        _resolve(_image(), lock={"pydantic": "2", "pydantic-core": "2"})


def test_the_shipped_image_needs_deepspeed_and_its_pydantic_and_nothing_it_has(repo_root):
    image = load_image(repo_root / "configs" / "images" / "gpu-node-cuda13-py312.yaml")
    got = {n.name: n.version for n in resolve(image, read_lock(repo_root / "requirements.lock"))}
    assert {"deepspeed", "pydantic", "pydantic-core", "hjson"} <= set(got)
    assert not set(got) & set(image.packages)
    assert got["pydantic"] == read_lock(repo_root / "requirements.lock")["pydantic"]


def test_read_lock_refuses_an_unpinned_line(tmp_path):
    lock = tmp_path / "requirements.lock"
    lock.write_text("# pins\nPyYAML==6.0.3\ntorch>=2\n")
    with pytest.raises(ValueError, match=r"requirements.lock:3: 'torch>=2' is not name==version"):
        read_lock(lock)
