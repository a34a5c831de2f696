"""A small built-in image-caption chat set: real images shipped by installed packages, captions written for
varpack.

The images are scikit-image's sample data (``skimage/data/*.png|jpg``, BSD-3 / public-domain sources listed
in ``skimage/data/README.txt``) and matplotlib's ``mpl-data/sample_data/grace_hopper.jpg``; they are found
at run time in the installed packages (no download). Their sizes differ (172x448 to 1000x872 pixels, gray,
RGB and RGBA), so an image processor gives them different ``image_grid_thw``. The captions and questions
below were written for this project by looking at each image.

:func:`builtin_vl_chats` mixes the image chats with text-only chats, which is what a vision-language SFT
set looks like and what packing must handle (image and text samples in one pack).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["VL_CAPTIONS", "VL_TEXT_CHATS", "builtin_vl_chats", "package_image_path", "write_vl_jsonl"]

#: (package, file, question, caption) — captions written for varpack
VL_CAPTIONS: tuple[tuple[str, str, str, str], ...] = (
    (
        "skimage",
        "astronaut.png",
        "Describe this photo.",
        "A smiling astronaut in an orange launch-and-entry suit poses with her helmet beside her. An American "
        "flag hangs on the left and a model of the Space Shuttle stands behind her shoulder.",
    ),
    (
        "skimage",
        "chelsea.png",
        "What animal is this, and what is it doing?",
        "A tabby cat with green eyes and orange-brown striped fur looks straight at the camera; only its face "
        "and ears fill the frame.",
    ),
    (
        "skimage",
        "coffee.png",
        "What is on the table?",
        "A red cup of espresso with a light crema sits on a matching red saucer with a small spoon, on a "
        "wooden table.",
    ),
    (
        "skimage",
        "rocket.jpg",
        "Caption the image in one sentence.",
        "A white rocket stands on its launch pad at night between tall lightning towers, lit by floodlights "
        "under a deep blue sky.",
    ),
    (
        "skimage",
        "coins.png",
        "How are the objects arranged?",
        "About two dozen old coins lie on a dark background in four rough rows; the grayscale photo shows "
        "their embossed faces.",
    ),
    (
        "skimage",
        "horse.png",
        "What shape is shown?",
        "The black silhouette of a standing horse, seen from the side and facing right, on a plain white "
        "background.",
    ),
    (
        "skimage",
        "text.png",
        "What does this picture show?",
        "A photo of handwritten mathematics on lined paper, taken at an angle: integral signs, fractions and "
        "an equation in dark ink.",
    ),
    (
        "skimage",
        "page.png",
        "Read the heading.",
        'The heading says "Region-based segmentation". Below it a paragraph explains how markers for the '
        "coins and the background are chosen from the histogram of grey values.",
    ),
    (
        "skimage",
        "camera.png",
        "Describe the scene.",
        "A grayscale photo of a man in a dark coat looking through a camera on a tripod, standing on a lawn "
        "with buildings far in the background.",
    ),
    (
        "skimage",
        "motorcycle_left.png",
        "What vehicle is in the garage?",
        "A red motorcycle with a black seat and chrome engine parts stands in a cluttered garage with boxes "
        "on the shelves behind it.",
    ),
    (
        "skimage",
        "hubble_deep_field.jpg",
        "What are the dots of light?",
        "Hundreds of distant galaxies, small spirals and ellipses in white, orange and blue, scattered over "
        "a black sky: a deep-field telescope image.",
    ),
    (
        "skimage",
        "logo.png",
        "Describe the logo.",
        "A round logo split into a green half and an orange half by an S-shaped curve, with a snake drawn "
        "over both halves.",
    ),
    (
        "matplotlib",
        "grace_hopper.jpg",
        "Who could this be? Describe the portrait.",
        "A formal portrait of an older woman in a dark navy uniform with medal ribbons and an officer's cap, "
        "in front of an American flag. It is the well-known portrait of Rear Admiral Grace Hopper.",
    ),
    (
        "skimage",
        "cell.png",
        "What is visible in this microscope image?",
        "A grayscale microscope image with one bright, roughly round cell on the right side of a blurred, "
        "dim background.",
    ),
)

#: text-only chats mixed into the set (written for varpack)
VL_TEXT_CHATS: tuple[tuple[str, str], ...] = (
    (
        "Why do image tokens need special positions in Qwen-VL models?",
        "Because an image is a 2-D grid: the model gives each image token a height and a width position, so "
        "positions inside an image repeat and jump instead of counting up one by one.",
    ),
    (
        "What is padding-free packing?",
        "Several short training samples are concatenated into one row without pad tokens, and the attention "
        "is told where each sample starts so that no sample can see another.",
    ),
    (
        "Give me a one-line tip for writing captions.",
        "Say what is in the picture, where it is, and one detail that makes it different from similar pictures.",
    ),
    ("What is 12 times 7?", "12 times 7 is 84."),
)


def package_image_path(package: str, file: str) -> str:
    """Absolute path of a sample image shipped by an installed package.

    Args:
        package: ``"skimage"`` (``skimage/data/``) or ``"matplotlib"`` (``mpl-data/sample_data/``).
        file: file name inside that folder.

    Raises:
        ValueError: unknown package, package not installed, or the file is missing from it.
    """
    if package == "skimage":
        try:
            import skimage
        except ImportError as exc:
            raise ValueError("scikit-image is not installed (pip install 'varpack[vision]')") from exc
        folder = Path(skimage.__file__).parent / "data"
    elif package == "matplotlib":
        import matplotlib

        folder = Path(matplotlib.get_data_path()) / "sample_data"
    else:
        raise ValueError(f"unknown image package {package!r}; expected 'skimage' or 'matplotlib'")
    path = folder / file
    if not path.is_file():
        raise ValueError(f"{package} does not ship {file!r} (looked in {str(folder)!r})")
    return str(path)


def builtin_vl_chats(*, include_text: bool = True, limit: int | None = None) -> list[dict[str, Any]]:
    """The built-in image-caption chats (``{"messages": [...]}``), image paths absolute.

    Each image chat is a user turn ``[image, question]`` and an assistant caption. With ``include_text``
    the text-only chats are interleaved (one after every few image chats) so packs mix both kinds.

    Args:
        include_text: mix in :data:`VL_TEXT_CHATS`.
        limit: keep the first ``limit`` image chats (all when None).

    Raises:
        ValueError: a package image is missing (see :func:`package_image_path`).
    """
    captions = VL_CAPTIONS if limit is None else VL_CAPTIONS[: int(limit)]
    chats: list[dict[str, Any]] = []
    texts = list(VL_TEXT_CHATS) if include_text else []
    every = max(1, len(captions) // max(1, len(texts))) if texts else 0
    for i, (package, file, question, caption) in enumerate(captions):
        chats.append(
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image", "image": package_image_path(package, file)},
                            {"type": "text", "text": question},
                        ],
                    },
                    {"role": "assistant", "content": caption},
                ]
            }
        )
        if texts and (i + 1) % every == 0:
            q, a = texts.pop(0)
            chats.append({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
    for q, a in texts:
        chats.append({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
    return chats


def write_vl_jsonl(path: str | os.PathLike, **kwargs: Any) -> str:
    """Write :func:`builtin_vl_chats` (``**kwargs`` passed on) as JSON Lines; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        for chat in builtin_vl_chats(**kwargs):
            fh.write(json.dumps(chat, ensure_ascii=False) + "\n")
    return str(path)
