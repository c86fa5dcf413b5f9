"""The H3 audio VAE: diffusers' `AutoencoderKLMiniMaxH3Audio` plus the checkpoint's latent normalisation.

The VAE is mono: stereo travels as two batch items. The DiT carries audio as channel-major rows [2A, 32] (all left
latents, then all right); a latent covers 800 samples at 32 kHz. Reference soundtracks take the posterior mean.
"""

from __future__ import annotations

import torch

from .packing import AUDIO_CHANNELS, audio_to_rows, rows_to_audio


class AudioVAE:
    def __init__(self, vae, latents_mean, latents_std):
        self.vae = vae.eval().requires_grad_(False)
        self.latents_mean = torch.as_tensor(latents_mean, dtype=torch.float32).view(1, -1, 1)
        self.latents_std = torch.as_tensor(latents_std, dtype=torch.float32).view(1, -1, 1)

    @property
    def sample_rate(self) -> int:
        return int(self.vae.config.sampling_rate)

    @property
    def hop_length(self) -> int:
        return int(self.vae.hop_length)

    @property
    def device(self) -> torch.device:
        return self.vae.dec_in_proj.weight.device

    @torch.no_grad()
    def decode_rows(self, rows_AC: torch.Tensor) -> torch.Tensor:
        """Normalised channel-major rows [2A, C] -> waveform float32 [2, A * 800] in [-1, 1]."""
        latents = rows_to_audio(rows_AC.float().cpu(), AUDIO_CHANNELS)  # [2, C, A]
        latents = latents * self.latents_std + self.latents_mean
        wave = self.vae.decode(latents.to(self.device), return_dict=False)[0]  # [2, 1, N]
        return wave.float()[:, 0].cpu()

    @torch.no_grad()
    def encode_rows(self, waveform_2N: torch.Tensor) -> torch.Tensor:
        """Stereo waveform [2, N] at 32 kHz -> normalised rows [2a, C] (posterior mean, never sampled)."""
        if waveform_2N.ndim != 2 or waveform_2N.shape[0] != AUDIO_CHANNELS:
            raise ValueError(f"Reference audio must be a stereo waveform [2, samples], got {tuple(waveform_2N.shape)}.")
        posterior = self.vae.encode(waveform_2N.float().to(self.device)[:, None], return_dict=False)[0]
        latents = posterior.mode().float().cpu()  # [2, C, a]
        return audio_to_rows((latents - self.latents_mean) / self.latents_std)
