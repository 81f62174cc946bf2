"""How many tokens an image or a video becomes in a Qwen-VL row, from its size alone (pure: nothing is decoded).

Images. ms-swift resizes an image twice before the processor cuts it into patches (``template/base.py``
``_preprocess_inputs``, then ``qwen_vl_utils.fetch_image``):

1. the template's ``max_pixels`` (``--max_pixels``), when set: an image above it is scaled to it, keeping its aspect
   ratio (``vision_utils.rescale_image``: ``h = int(sqrt(max / ratio))``, ``w = int(h * ratio)``);
2. ``qwen_vl_utils.smart_resize``: both sides rounded to a multiple of ``factor`` (patch x merge: 28 for Qwen2 /
   Qwen2.5-VL, 32 for Qwen3-VL), the area brought within ``[min_pixels, max_pixels]`` (``MIN_PIXELS`` /
   ``MAX_PIXELS``, or ``IMAGE_MIN_TOKEN_NUM`` / ``IMAGE_MAX_TOKEN_NUM`` x ``factor^2``, as ms-swift sets them from
   the environment).

The image is then ``(h / factor) x (w / factor)`` tokens in its row (each of ``merge^2`` patches through the vision
tower). :class:`ResizeRule` holds the numbers a run trains with; :func:`image_tokens` applies them.

Videos (qwen-vl-utils 0.0.14 ``fetch_video``, as ms-swift's ``Qwen2VLTemplate.replace_tag`` calls it; the template's
``max_pixels`` does not apply to videos). :class:`VideoRule` holds the numbers, :func:`video_tokens` applies them:

1. the frames: a video file's ``T`` frames at ``fps`` are sampled to ``smart_nframes``: ``T / fps x FPS`` frames,
   within ``[ceil2(FPS_MIN_FRAMES), floor2(min(FPS_MAX_FRAMES, T))]`` and at most ``T``, rounded down to a multiple of
   ``FRAME_FACTOR`` (2; ``ceil2`` / ``floor2``: to a multiple of it). A list of image files (ms-swift's ``videos``
   entry as a list of frames) is not sampled: its ``n`` frames are padded with the last one to ``ceil2(n)``; each
   frame is first resized as an image by ``smart_resize`` with the factor ``factor x merge side`` (qwen-vl-utils
   0.0.14 passes its image factor, 28, where ``fetch_image`` takes a patch size: 56 for Qwen2-VL) and the image
   limits ``IMAGE_MIN_TOKEN_NUM`` / ``IMAGE_MAX_TOKEN_NUM`` x that factor squared;
2. the frame size: ``smart_resize`` of the (first-resized) frame with ``factor``, within ``[min_pixels, max]``:
   ``min_pixels = VIDEO_MIN_TOKEN_NUM x factor^2``, ``max = max(min(VIDEO_MAX_TOKEN_NUM x factor^2, total_pixels /
   frames x FRAME_FACTOR), int(1.05 x min_pixels))``, ``total_pixels = MODEL_SEQ_LEN x factor^2 x 0.9``;
3. the tokens: the processor merges ``temporal_patch`` (2) frames into one (padding with the last frame), so a video
   is ``ceil(frames / temporal_patch) x (h / factor) x (w / factor)`` tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields


#: lower limits a run may set to 0 (qwen-vl-utils takes them)
_ZERO_OK = ('min_pixels', 'min_frames', 'list_min_pixels')


def _check_positive(rule: object, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(rule, name)
        low = 0 if name in _ZERO_OK else None
        if (not isinstance(value, (int, float)) or isinstance(value, bool)
                or not (value >= 0 if low is not None else value > 0)):
            raise ValueError(f'{type(rule).__name__}.{name} must be a number {">= 0" if low is not None else "> 0"}, '
                             f'got {name}={value!r}')


def _check_range(rule: object, low: str, high: str) -> None:
    if getattr(rule, low) > getattr(rule, high):
        raise ValueError(f'{type(rule).__name__}.{low} must be <= {high} ({getattr(rule, high)!r}), got '
                         f'{low}={getattr(rule, low)!r}')


@dataclass(frozen=True)
class VideoRule:
    """How a run's videos become tokens (module docstring, videos), from qwen-vl-utils' limits as ms-swift set them
    from the environment (``FPS``, ``FPS_MIN_FRAMES``, ``FPS_MAX_FRAMES``, ``VIDEO_MIN_TOKEN_NUM`` /
    ``VIDEO_MAX_TOKEN_NUM`` or ``VIDEO_MIN_PIXELS`` / ``VIDEO_MAX_PIXELS``, ``MODEL_SEQ_LEN``, ``FRAME_FACTOR``).

    Attributes:
        factor: a frame's sides become multiples of it (patch size x spatial merge).
        min_pixels, max_pixels: a frame's area limits (``VIDEO_MIN_TOKEN_NUM`` / ``VIDEO_MAX_TOKEN_NUM`` x
            ``factor^2``); ``max_pixels`` is lowered further by ``total_pixels``.
        total_pixels: the pixels of a whole video (``MODEL_SEQ_LEN x factor^2 x 0.9``), shared by its frames.
        fps: frames a second sampled from a video file (``FPS``).
        min_frames, max_frames: the frames sampled from a video file (``FPS_MIN_FRAMES``, ``FPS_MAX_FRAMES``).
        frame_factor: frame counts are multiples of it (``FRAME_FACTOR``).
        temporal_patch: frames merged into one temporal patch by the processor (``temporal_patch_size``).
        list_factor, list_min_pixels, list_max_pixels: the first resize of each frame of a list of image files
            (``factor x merge side``; ``IMAGE_MIN_TOKEN_NUM`` / ``IMAGE_MAX_TOKEN_NUM`` x ``list_factor^2``).

    Raises:
        ValueError: a field that is not a number > 0 (``min_pixels``, ``min_frames``, ``list_min_pixels``: >= 0), or a
            lower limit above its upper one (the field named).
    """

    factor: int = 28
    min_pixels: int = 128 * 28 * 28
    max_pixels: int = 768 * 28 * 28
    total_pixels: float = 128000 * 28 * 28 * 0.9
    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    frame_factor: int = 2
    temporal_patch: int = 2
    list_factor: int = 56
    list_min_pixels: int = 4 * 56 * 56
    list_max_pixels: int = 16384 * 56 * 56

    def __post_init__(self) -> None:
        _check_positive(self, tuple(f.name for f in fields(self)))
        _check_range(self, 'min_pixels', 'max_pixels')
        _check_range(self, 'list_min_pixels', 'list_max_pixels')


@dataclass(frozen=True)
class ResizeRule:
    """The resize a run's images go through (module docstring), and how its videos become tokens.

    Attributes:
        factor: both sides become multiples of it (patch size x spatial merge).
        min_pixels, max_pixels: the area ``smart_resize`` keeps an image within.
        template_max_pixels: the template's ``max_pixels`` applied first (``None``: not set).
        merge: patches a token (``spatial_merge_size^2``): the vision tower's patches are ``merge x`` the tokens.
        video: how the run's videos become tokens (``None``: videos are not counted).

    Raises:
        ValueError: a size that is not a number > 0 (``min_pixels``: >= 0), or ``min_pixels`` above ``max_pixels``
            (the field named).
    """

    factor: int = 28
    min_pixels: int = 4 * 28 * 28
    max_pixels: int = 16384 * 28 * 28
    template_max_pixels: int | None = None
    merge: int = 4
    video: VideoRule | None = None

    def __post_init__(self) -> None:
        _check_positive(self, ('factor', 'min_pixels', 'max_pixels', 'merge')
                        + (('template_max_pixels', ) if self.template_max_pixels is not None else ()))
        _check_range(self, 'min_pixels', 'max_pixels')


@dataclass(frozen=True)
class Video:
    """A video as its files' headers give it.

    Attributes:
        frames: the frames of the file, or the image files of a list of frames.
        width, height: a frame's size in pixels (a list's largest frame).
        fps: the file's frame rate (``None``: a list of frames, which is not sampled).
    """

    frames: int
    width: int
    height: int
    fps: float | None = None

    def __post_init__(self) -> None:
        _check_positive(self, ('frames', 'width', 'height') + (('fps', ) if self.fps is not None else ()))


def smart_resize(width: int, height: int, factor: int, min_pixels: float, max_pixels: float) -> tuple[int, int]:
    """``(width, height)`` after ``qwen_vl_utils.smart_resize``: both sides multiples of ``factor``, the area within
    ``[min_pixels, max_pixels]``, the aspect ratio about kept."""
    h, w = max(factor, _round(height, factor)), max(factor, _round(width, factor))
    if h * w > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h, w = math.floor(height / beta / factor) * factor, math.floor(width / beta / factor) * factor
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return w, h


def _round(x: float, factor: int) -> int:
    return round(x / factor) * factor


def resized(width: int, height: int, rule: ResizeRule) -> tuple[int, int]:
    """``(width, height)`` of an image of ``width x height`` pixels after both resizes of ``rule``."""
    if rule.template_max_pixels and width * height > rule.template_max_pixels:
        ratio = width / height
        height = int(math.sqrt(rule.template_max_pixels / ratio))
        width = int(height * ratio)
    return smart_resize(width, height, rule.factor, rule.min_pixels, rule.max_pixels)


def image_tokens(width: int, height: int, rule: ResizeRule) -> int:
    """The tokens an image of ``width x height`` pixels becomes in its row under ``rule``."""
    w, h = resized(width, height, rule)
    return (w // rule.factor) * (h // rule.factor)


def sampled_frames(video: Video, rule: VideoRule) -> int:
    """The frames of ``video`` the processor sees (module docstring, videos, 1): a list's frames padded to a multiple
    of ``frame_factor``; a file's ``smart_nframes``.

    Raises:
        ValueError: a file whose frames cannot be sampled (fewer than ``frame_factor`` result), as qwen-vl-utils
            raises for it.
    """
    k = rule.frame_factor
    if video.fps is None:
        return math.ceil(video.frames / k) * k
    low = math.ceil(rule.min_frames / k) * k
    high = math.floor(min(rule.max_frames, video.frames) / k) * k
    n = video.frames / video.fps * rule.fps
    n = math.floor(min(min(max(n, low), high), video.frames) / k) * k
    if not k <= n <= video.frames:
        raise ValueError(f'a video of {video.frames} frames at {video.fps} fps gives {n} frames, not within '
                         f'[{k}, {video.frames}] (qwen-vl-utils refuses it)')
    return n


def video_size(video: Video, rule: VideoRule) -> tuple[int, int]:
    """``(width, height)`` of each of ``video``'s frames as the processor sees them (module docstring, videos, 2)."""
    width, height = video.width, video.height
    if video.fps is None:  # a list of image files: each resized as an image first
        width, height = smart_resize(width, height, rule.list_factor, rule.list_min_pixels, rule.list_max_pixels)
    frames = sampled_frames(video, rule)
    most = max(min(rule.max_pixels, rule.total_pixels / frames * rule.frame_factor), int(rule.min_pixels * 1.05))
    return smart_resize(width, height, rule.factor, rule.min_pixels, most)


def video_tokens(video: Video, rule: VideoRule) -> int:
    """The tokens ``video`` becomes in its row under ``rule`` (module docstring, videos, 3)."""
    w, h = video_size(video, rule)
    return math.ceil(sampled_frames(video, rule) / rule.temporal_patch) * (w // rule.factor) * (h // rule.factor)
