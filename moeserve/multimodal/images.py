"""An image from a request: a `data:` URL, or an http(s) URL on an allowed host, decoded by
Pillow (PNG, JPEG, WebP) into RGB, with its size checked before anything is decoded."""

from __future__ import annotations

import base64
import binascii
import io
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

FORMATS = ("PNG", "JPEG", "WEBP")
MEDIA_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/webp": "WEBP"}
_READ_CHUNK = 1 << 16


class ImageError(ValueError):
    """An image a request cannot use (one sentence, for the client)."""


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int
    max_pixels: int
    fetch_timeout: float
    allowed_domains: frozenset[str] = frozenset()

    @staticmethod
    def parse_domains(value: str | None) -> frozenset[str]:
        """`--allowed-media-domains a.com,b.org` -> the lower-cased host names."""
        if not value:
            return frozenset()
        return frozenset(d.strip().lower() for d in value.split(",") if d.strip())


def load_image(url: str, limits: ImageLimits) -> Image.Image:
    """The image a URL names, as RGB; `ImageError` for anything a client got wrong."""
    if url.startswith("data:"):
        data = _data_url_bytes(url, limits.max_bytes)
    elif url.startswith(("http://", "https://")):
        data = _fetch(url, limits)
    else:
        raise ImageError("the image URL must be a data: URL or an http(s) URL")
    return decode_image(data, limits.max_pixels)


def decode_image(data: bytes, max_pixels: int) -> Image.Image:
    """PNG, JPEG or WebP bytes -> an RGB image; the header's size is checked first, so a
    small file that would decode to a huge image is refused before it is decoded."""
    try:
        img = Image.open(io.BytesIO(data), formats=FORMATS)
    except UnidentifiedImageError:
        raise ImageError("the image is not a PNG, JPEG or WebP file") from None
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise ImageError(f"the image cannot be read ({e})") from None
    w, h = img.size
    if w < 1 or h < 1:
        raise ImageError("the image has no pixels")
    if w * h > max_pixels:
        raise ImageError(f"the image is {w} x {h} pixels; at most {max_pixels:,} are accepted")
    try:
        img.load()
        return img.convert("RGB")
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise ImageError(f"the image is corrupt ({e})") from None


def _data_url_bytes(url: str, max_bytes: int) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep or not head.endswith(";base64"):
        raise ImageError("a data: URL must be data:image/...;base64,<data>")
    media_type = head[len("data:") : -len(";base64")].strip().lower()
    if media_type not in MEDIA_TYPES:
        raise ImageError(
            f"image type {media_type or '(none)'!r} is not supported; send image/png, "
            "image/jpeg or image/webp"
        )
    # base64 grows data by 4/3: refuse what cannot fit before decoding it
    if len(payload) > 4 * (-(-max_bytes // 3)) + 4:
        raise ImageError(f"the image is larger than {max_bytes:,} bytes")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("the data: URL does not hold valid base64") from None
    if len(data) > max_bytes:
        raise ImageError(f"the image is larger than {max_bytes:,} bytes")
    return data


def _check_host(url: str, allowed: frozenset[str]) -> None:
    host = (urllib.parse.urlsplit(url).hostname or "").lower()
    if host not in allowed:
        raise ImageError(
            f"image URLs on host {host!r} are not allowed (the server's "
            "--allowed-media-domains); send the image as a data: URL"
        )


class _AllowedRedirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to an allowed host."""

    def __init__(self, allowed: frozenset[str]) -> None:
        self.allowed = allowed

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        _check_host(newurl, self.allowed)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _fetch(url: str, limits: ImageLimits) -> bytes:
    _check_host(url, limits.allowed_domains)
    opener = urllib.request.build_opener(_AllowedRedirects(limits.allowed_domains))
    req = urllib.request.Request(url, headers={"User-Agent": "moeserve"})
    deadline = time.monotonic() + limits.fetch_timeout
    try:
        with opener.open(req, timeout=limits.fetch_timeout) as resp:
            out = bytearray()
            while True:
                chunk = resp.read(_READ_CHUNK)
                if not chunk:
                    break
                out += chunk
                if len(out) > limits.max_bytes:
                    raise ImageError(f"the image is larger than {limits.max_bytes:,} bytes")
                if time.monotonic() > deadline:
                    raise ImageError(
                        f"fetching the image took longer than {limits.fetch_timeout:g} s"
                    )
            return bytes(out)
    except ImageError:
        raise
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise ImageError(f"the image URL could not be fetched ({e})") from None
