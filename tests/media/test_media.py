"""h3trt.media.mp4 and h3trt.media.inputs: MP4 output checked by decoding it back, and the input readers' errors.

Tolerances (measured with PyAV 18.1's bundled FFmpeg / libx264, CRF 18):
- Audio: AAC output is never shorter than the samples written and at most one AAC frame (1024 samples = 32 ms at
  32 kHz) longer, because decoders return the final, partially filled frame whole. Measured: +363 samples (29333
  written, 29696 decoded = 29 frames of 1024); encoder priming is removed by the MP4 edit list, so it adds nothing.
- Audio waveform: after the first/last 2048 samples, within 0.05 of the input sines (measured 0.014).
- Video: per-frame mean absolute error below 3 levels on a smooth gradient (measured 1.85 max); flat saturated
  colours within 4 levels per channel (measured 2; a BT.601/BT.709 matrix mismatch gives ~30).
"""

from __future__ import annotations

import struct
import threading
import wave
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from PIL import Image

from h3trt.media.inputs import MediaError, probe, read_audio, read_image, read_video
from h3trt.media.mp4 import Mp4Writer, write_mp4

FPS, RATE = 24, 32000
T, W, H = 22, 64, 96  # 64x96 is width x height
N_SAMPLES = RATE * T // FPS  # 22/24 s = 29333 samples
LEFT_HZ, RIGHT_HZ = 440.0, 1000.0
AAC_FRAME = 1024


def gradient_frames() -> np.ndarray:
    """Smooth horizontal/vertical ramps, with blue stepping by 10 per frame so a dropped or repeated frame shows."""
    y, x = np.mgrid[0:H, 0:W]
    frames = np.empty((T, H, W, 3), np.uint8)
    frames[..., 0] = np.round(x * 255 / (W - 1)).astype(np.uint8)
    frames[..., 1] = np.round(y * 255 / (H - 1)).astype(np.uint8)
    frames[..., 2] = (np.arange(T, dtype=np.uint8) * 10)[:, None, None]
    return frames


def stereo_sine() -> np.ndarray:
    t = np.arange(N_SAMPLES) / RATE
    return (0.5 * np.stack([np.sin(2 * np.pi * LEFT_HZ * t), np.sin(2 * np.pi * RIGHT_HZ * t)])).astype(np.float32)


def dominant_hz(channel: np.ndarray) -> float:
    spectrum = np.abs(np.fft.rfft(channel * np.hanning(len(channel))))
    return float(np.argmax(spectrum) * RATE / len(channel))


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> Path:
    """The 22-frame clip, frames fed in uneven chunks and audio in two calls, as the streaming runtime does."""
    path = tmp_path_factory.mktemp("media") / "clip.mp4"
    frames, audio = gradient_frames(), stereo_sine()
    with Mp4Writer(path, W, H) as writer:
        for lo, hi in ((0, 1), (1, 9), (9, 17), (17, T)):
            writer.write_frames(frames[lo:hi])
        writer.write_audio(audio[:, :10000])
        writer.write_audio(torch.from_numpy(audio[:, 10000:]))
    return path


def test_probe_reports_exact_frames_and_aac_stereo(clip):
    info = probe(clip)
    assert info["video_codec"] == "h264"
    assert info["pix_fmt"] == "yuv420p"
    assert (info["width"], info["height"]) == (W, H)
    assert info["fps"] == 24.0
    assert info["frames"] == T
    assert info["audio_codec"] == "aac"
    assert info["sample_rate"] == RATE
    assert info["audio_channels"] == 2
    excess = round(info["audio_duration"] * RATE) - N_SAMPLES
    assert 0 <= excess < AAC_FRAME, f"decoded audio is {excess} samples off the {N_SAMPLES} written"


def test_left_and_right_channels_stay_apart(clip):
    audio = read_audio(clip)
    assert abs(dominant_hz(audio[0]) - LEFT_HZ) < 5
    assert abs(dominant_hz(audio[1]) - RIGHT_HZ) < 5


def test_audio_is_time_aligned(clip):
    # Priming samples left in (or a pts error) would shift the waveform and blow this far past AAC's coding noise.
    audio = read_audio(clip)[:, :N_SAMPLES]
    assert np.abs(audio[:, 2048:-2048] - stereo_sine()[:, 2048:-2048]).max() < 0.05


def test_chunked_frames_decode_close_to_input(clip):
    frames, fps, audio = read_video(clip)
    assert frames.shape == (T, H, W, 3) and frames.dtype == np.uint8
    assert fps == 24.0
    assert audio is not None and audio.shape[0] == 2 and 0 <= audio.shape[1] - N_SAMPLES < AAC_FRAME
    per_frame_mae = np.abs(frames.astype(np.float32) - gradient_frames()).mean(axis=(1, 2, 3))
    assert per_frame_mae.max() < 3.0, per_frame_mae


def test_saturated_colours_use_one_matrix_both_ways(tmp_path):
    frames = np.zeros((2, 64, 96, 3), np.uint8)
    frames[:, :, :48] = (20, 220, 60)
    frames[:, :, 48:] = (230, 40, 90)
    decoded, _, audio = read_video(write_mp4(tmp_path / "flat.mp4", torch.from_numpy(frames), None))
    assert audio is None
    centre = np.abs(decoded[:, 8:-8, 8:40].astype(int) - frames[:, 8:-8, 8:40]).max()
    right = np.abs(decoded[:, 8:-8, 56:-8].astype(int) - frames[:, 8:-8, 56:-8]).max()
    assert max(centre, right) <= 4


def test_exception_in_block_leaves_no_file(tmp_path):
    final = tmp_path / "out.mp4"
    with pytest.raises(RuntimeError, match="boom"):
        with Mp4Writer(final, W, H) as writer:
            writer.write_frames(gradient_frames()[:3])
            partial = writer.partial_path
            assert partial.exists() and partial.name.startswith(".") and not partial.name.endswith(".mp4")
            assert not final.exists()
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_missing_audio_track_is_an_error_and_leaves_no_file(tmp_path):
    with pytest.raises(MediaError, match="no audio was written"):
        with Mp4Writer(tmp_path / "out.mp4", W, H) as writer:
            writer.write_frames(gradient_frames()[:2])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("size", [(63, 96), (64, 95)])
def test_odd_size_rejected(tmp_path, size):
    with pytest.raises(MediaError, match="even"):
        Mp4Writer(tmp_path / "out.mp4", *size)


def test_bad_inputs_rejected(tmp_path):
    with Mp4Writer(tmp_path / "out.mp4", W, H) as writer:
        with pytest.raises(MediaError, match="uint8"):
            writer.write_frames(gradient_frames().astype(np.float32))
        with pytest.raises(MediaError, match="expected"):
            writer.write_frames(gradient_frames()[:, :, :32])
        with pytest.raises(MediaError, match="exceeds 1.0"):
            writer.write_audio(np.full((2, 100), 1.5, np.float32))
        with pytest.raises(MediaError, match=r"expected \[T, 144, 64\]"):  # yuv420p: H * 3 / 2 rows
            writer.write_yuv420(np.zeros((1, H, W), np.uint8))
        with pytest.raises(MediaError, match="expected uint8"):
            writer.write_yuv420(np.zeros((1, H * 3 // 2, W), np.float32))
        writer.write_yuv420(np.full((1, H * 3 // 2, W), 128, np.uint8))  # mid grey, as planes
        writer.write_frames(gradient_frames()[:1])
        writer.write_audio(np.zeros((2, 100), np.float32))
    assert probe(tmp_path / "out.mp4")["frames"] == 2
    assert list(writer.marks) == ["audio_flushed", "video_flushed", "closed", "renamed"]  # the host-tail steps
    assert sorted(writer.marks.values()) == list(writer.marks.values())
    with pytest.raises(MediaError, match="not an x264 preset"):
        Mp4Writer(tmp_path / "fast.mp4", W, H, preset="turbo")


def test_writer_driven_from_background_thread(tmp_path):
    frames, audio = torch.from_numpy(gradient_frames()), stereo_sine()
    errors: list[BaseException] = []
    with Mp4Writer(tmp_path / "bg.mp4", W, H) as writer:
        def encode() -> None:
            try:
                for lo in range(0, T, 5):
                    writer.write_frames(frames[lo:lo + 5])
                writer.write_audio(audio)
            except BaseException as err:  # noqa: BLE001 - re-raised on the main thread below
                errors.append(err)
        worker = threading.Thread(target=encode)
        worker.start()
        worker.join()
    assert not errors
    assert probe(tmp_path / "bg.mp4")["frames"] == T


def test_read_image_errors_and_round_trip(tmp_path):
    with pytest.raises(MediaError, match="does not exist"):
        read_image(tmp_path / "missing.png")
    fake = tmp_path / "notes.png"
    fake.write_text("not an image")
    with pytest.raises(MediaError, match="is not a readable image"):
        read_image(fake)
    pixels = np.random.default_rng(0).integers(0, 256, (20, 30, 4), dtype=np.uint8)
    Image.fromarray(pixels, "RGBA").save(tmp_path / "ok.png")
    image = read_image(tmp_path / "ok.png")
    assert image.mode == "RGB"
    np.testing.assert_array_equal(np.asarray(image), pixels[..., :3])


def write_wav(path: Path, samples: np.ndarray, rate: int) -> None:
    """samples: float [channels, N] in [-1, 1], written as 16-bit PCM with the stdlib."""
    with wave.open(str(path), "wb") as wav:
        wav.setnchannels(samples.shape[0])
        wav.setsampwidth(2)
        wav.setframerate(rate)
        wav.writeframes(np.round(samples.T * 32767).astype("<i2").tobytes())


def test_read_audio_mono_wav_becomes_stereo_at_32k(tmp_path):
    t = np.arange(16000) / 16000
    write_wav(tmp_path / "mono.wav", 0.5 * np.sin(2 * np.pi * 300 * t)[None], 16000)
    audio = read_audio(tmp_path / "mono.wav")
    assert audio.shape == (2, 32000) and audio.dtype == np.float32
    np.testing.assert_array_equal(audio[0], audio[1])
    # Duplicated, not upmixed: swresample's mono->stereo would scale the 0.5 peak down to 0.35.
    assert abs(np.abs(audio).max() - 0.5) < 0.01


def test_read_audio_resamples_stereo_and_downmixes_surround(tmp_path):
    write_wav(tmp_path / "st.wav", np.zeros((2, 48000)), 48000)
    assert read_audio(tmp_path / "st.wav").shape == (2, 32000)
    with av.open(str(tmp_path / "surround.wav"), "w") as container:
        stream = container.add_stream("pcm_s16le", rate=48000, layout="5.1")
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 4800 * 6), np.int16), format="s16", layout="5.1")
        frame.sample_rate = 48000
        container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    assert read_audio(tmp_path / "surround.wav").shape == (2, 3200)


def test_readers_reject_missing_unreadable_and_wrong_streams(tmp_path, clip):
    with pytest.raises(MediaError, match="does not exist"):
        read_audio(tmp_path / "missing.wav")
    junk = tmp_path / "junk.mp3"
    junk.write_bytes(b"\x00garbage" * 10)
    with pytest.raises(MediaError, match="is not a readable"):
        read_audio(junk)
    silent = write_mp4(tmp_path / "silent.mp4", gradient_frames()[:2], None)
    with pytest.raises(MediaError, match="has no audio stream"):
        read_audio(silent)
    write_wav(tmp_path / "a.wav", np.zeros((1, 100)), 16000)
    with pytest.raises(MediaError, match="has no video stream"):
        read_video(tmp_path / "a.wav")
    with pytest.raises(MediaError, match="does not exist"):
        read_video(tmp_path / "missing.mp4")
    assert probe(silent)["audio_codec"] is None and probe(silent)["frames"] == 2


# torchaudio 2.11.0's transforms.Resample(orig, 32000) (the reference's resampler) on the input of
# test_resample_is_the_reference_resampler, measured with torchaudio's own resample code: the output shape, channel 1
# at samples [0, 1, 100, 1000, last], and the rms over both channels.
TORCHAUDIO_RESAMPLE = {
    44100: ((2, 3200), [0.0134701, -0.5687336, 0.3510263, -0.139874, 0.3089489], 0.2462941),
    16000: ((2, 8820), [0.1183819, -0.1735882, -0.5486197, -0.3000498, 0.0714487], 0.2885352),
    22050: ((2, 6400), [0.1183819, -0.3289479, -0.462154, 0.2512765, 0.122018], 0.2885362),
    48000: ((2, 2940), [-0.0309547, -0.5115972, 0.158781, -0.0855912, 0.2713558], 0.235388),
}


@pytest.mark.parametrize("orig", sorted(TORCHAUDIO_RESAMPLE))
def test_resample_is_the_reference_resampler(orig):
    """Reference audio at other rates goes through the reference's resampler (torchaudio's windowed sinc), not
    swresample: measured before this change, swresample's output differed from it at 19.2 dB SNR (16 and 22.05 kHz
    chirps) to 37.1 dB (48 kHz); now h3trt reproduces torchaudio's numbers (bitwise on this CPU; 1e-6 here)."""
    from h3trt.media.inputs import resample

    x = (0.3 * np.random.default_rng(0).standard_normal((2, 4410))).astype(np.float32)
    shape, samples, rms = TORCHAUDIO_RESAMPLE[orig]
    out = resample(torch.from_numpy(x), orig, 32000)
    assert tuple(out.shape) == shape
    assert np.allclose(out[1, [0, 1, 100, 1000, shape[1] - 1]].numpy(), samples, atol=1e-6)
    assert abs(float(out.pow(2).mean().sqrt()) - rms) < 1e-6


def test_reference_audio_is_cut_at_its_own_rate_then_resampled(tmp_path):
    """As the reference: decoded at the file's rate, truncated there to the clip's length, resampled once."""
    from h3trt.media.inputs import resample

    rate, seconds = 22050, 3.0
    t = np.arange(int(rate * seconds)) / rate
    left = (0.4 * np.sin(2 * np.pi * 440 * t) * 32767).astype(np.int16)
    path = tmp_path / "s.wav"
    with wave.open(str(path), "wb") as w:
        w.setnchannels(2), w.setsampwidth(2), w.setframerate(rate)
        w.writeframes(np.stack([left, left // 2], 1).tobytes())
    got = read_audio(path, 32000, max_seconds=2.0)
    native = torch.from_numpy(np.stack([left, left // 2]).astype(np.float32) / 32768)[:, : int(2.0 * rate)]
    assert got.shape == (2, 64000) and np.allclose(got, resample(native, rate, 32000).numpy(), atol=1e-6)


def _rotate_tag(src: Path, dst: Path, matrix: tuple[int, ...]) -> Path:
    """A copy of an MP4 whose video track's display matrix (tkhd) is `matrix`, as phones tag portrait video."""
    data = bytearray(src.read_bytes())
    i = data.find(b"tkhd")
    times = 8 + 8 + 4 + 4 + 8 if data[i + 4] == 1 else 4 + 4 + 4 + 4 + 4  # version 1: 64-bit times and duration
    offset = i + 4 + 4 + times + 8 + 8  # past version/flags, times, reserved, layer/group/volume/reserved
    data[offset:offset + 36] = struct.pack(">9i", *matrix)
    dst.write_bytes(bytes(data))
    return dst


@pytest.mark.parametrize("matrix", [
    (0, 0x10000, 0, -0x10000, 0, 0, 0, 0, 0x40000000),  # 90 degrees
    (-0x10000, 0, 0, 0, -0x10000, 0, 0, 0, 0x40000000),  # 180
    (0, -0x10000, 0, 0x10000, 0, 0, 0, 0, 0x40000000),  # 270
])
def test_a_rotated_video_is_read_upright_as_the_reference_reads_it(tmp_path, matrix):
    from diffusers.modular_pipelines.minimax_h3.references import _decode_video_file

    frames = np.zeros((5, 32, 64, 3), np.uint8)
    frames[:, :8, :16] = 255  # a white top-left corner shows the orientation
    rotated = _rotate_tag(write_mp4(tmp_path / "plain.mp4", frames, None), tmp_path / "rotated.mp4", matrix)
    ours, _, _ = read_video(rotated)
    reference = _decode_video_file(str(rotated))[0]
    assert ours.shape == reference.shape and np.array_equal(ours, reference)
    assert ours.shape[1:3] == ((64, 32) if matrix[0] == 0 else (32, 64))
    plain = read_video(tmp_path / "plain.mp4")[0]
    assert ours.shape != plain.shape or not np.array_equal(ours, plain)  # turned, not read sideways
