"""The stages around the denoiser: text encoding, VAE decoding, image encoding and image metrics."""
