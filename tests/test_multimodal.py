"""Image inputs on a tiny random llava model (reference AA): equality with transformers, hash-keyed
prefix caching, the too-long abort, chunk boundaries inside an image, and bad input."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch

from tests.conftest import (
    TINY_CONFIG, assert_no_leak, check_greedy_equal, leak_checked_engines, save_random_model, tiny_settings,
)

IMAGE_TOKEN = "<image>"
IMAGE_SIZE, PATCH_SIZE = 32, 8
NUM_IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


def build_llava_folder(folder, tokenizer, seed: int) -> str:
    """A tiny random LlavaForConditionalGeneration (CLIP tower + llama) saved as an HF folder."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    text = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id, **TINY_CONFIG)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, image_size=IMAGE_SIZE, patch_size=PATCH_SIZE)
    config = LlavaConfig(vision_config=vision, text_config=text,
                         image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
                         tie_word_embeddings=True, image_seq_length=NUM_IMAGE_TOKENS)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    return save_random_model(model, folder, tokenizer)


@pytest.fixture(scope="session")
def llava_tokenizer(default_model_folder):
    from framework.model.loader import load_tokenizer

    tokenizer = load_tokenizer(default_model_folder)
    tokenizer.add_tokens([IMAGE_TOKEN], special_tokens=True)
    return tokenizer


@pytest.fixture(scope="session")
def llava_folder(tmp_path_factory, llava_tokenizer) -> str:
    return build_llava_folder(tmp_path_factory.mktemp("tiny-llava"), llava_tokenizer, seed=0)


def png_data_url(seed: int, size: int = 40) -> str:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def png_of_size(width: int, height: int) -> str:
    """Base64 of a black 1-bit PNG of any size: a few bytes for a 20000 x 20000 image (a PNG bomb)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = zlib.compress((b"\x00" * (1 + (width + 7) // 8)) * height, 9)
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", rows) + chunk(b"IEND", b"")
    return base64.b64encode(png).decode()


PNG_BOMB = png_of_size(20000, 20000)  # 4 * 10^8 pixels in 65 kB: over Pillow's limit


def image_prompt(num_images: int = 1) -> str:
    return "Describe " + " and ".join([IMAGE_TOKEN] * num_images) + " in a few words:"


@pytest.fixture
def make_llava_engine(llava_folder):
    yield from leak_checked_engines(llava_folder)


@pytest.fixture(scope="module")
def shared_engine(llava_folder):
    """One engine for the tests that need no settings of their own (an engine takes ~1 s)."""
    from framework.engine import Engine

    with Engine(tiny_settings(llava_folder)) as engine:
        yield engine


@pytest.fixture
def llava_engine(shared_engine):
    shared_engine.flush_cache()
    yield shared_engine
    assert_no_leak(shared_engine)


def test_llava_matches_transformers(llava_engine, llava_folder, llava_tokenizer):
    """Greedy outputs equal transformers' LlavaForConditionalGeneration on the same pixels."""
    from transformers import LlavaForConditionalGeneration

    from framework.images import ImageProcessor, open_image

    engine = llava_engine
    image = png_data_url(1)
    out = engine.generate(image_prompt(), GREEDY, image_data=image)
    assert out["meta_info"]["prompt_tokens"] == len(llava_tokenizer.encode(image_prompt())) - 1 + NUM_IMAGE_TOKENS

    hf = LlavaForConditionalGeneration.from_pretrained(llava_folder, dtype=torch.float32).eval()
    pixels = ImageProcessor.from_model_folder(llava_folder).pixels(open_image(image))[None]
    image_id = hf.config.image_token_index
    ids = []
    for t in llava_tokenizer.encode(image_prompt()):
        ids.extend([image_id] * NUM_IMAGE_TOKENS if t == image_id else [t])

    def ref_logprobs(prefix):
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([ids + prefix]), pixel_values=pixels).logits[0, -1]
        return torch.log_softmax(logits.float(), dim=-1)

    with torch.no_grad():
        ref = hf.generate(input_ids=torch.tensor([ids]), pixel_values=pixels, max_new_tokens=8,
                          min_new_tokens=8, do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
    check_greedy_equal(out["output_ids"], ref, ref_logprobs)


def test_same_image_shares_prefix_different_image_does_not(llava_engine, llava_tokenizer):
    engine = llava_engine
    prompt = image_prompt()
    prefix_len = llava_tokenizer.encode(prompt).index(llava_tokenizer.convert_tokens_to_ids(IMAGE_TOKEN))
    first = engine.generate(prompt, GREEDY, image_data=png_data_url(1))
    again = engine.generate(prompt, GREEDY, image_data=png_data_url(1))
    other = engine.generate(prompt, GREEDY, image_data=png_data_url(2))
    assert first["meta_info"]["cached_tokens"] == 0
    # The same image: everything but the recomputed last token comes from the cache.
    assert again["meta_info"]["cached_tokens"] >= prefix_len + NUM_IMAGE_TOKENS
    assert again["output_ids"] == first["output_ids"]
    # Another image: only the text before the image is shared.
    assert other["meta_info"]["cached_tokens"] <= prefix_len


def test_different_images_give_different_logits(llava_engine):
    engine = llava_engine
    outs = [
        engine.generate(image_prompt(), {"temperature": 0, "max_new_tokens": 1}, image_data=png_data_url(seed),
                        return_logprob=True, top_logprobs_num=5)
        for seed in (3, 4)
    ]
    tops = [o["meta_info"]["output_top_logprobs"][0] for o in outs]
    assert tops[0] != tops[1]


def test_pad_ids_follow_the_image_hash():
    from framework.multimodal import ImageInputs, ImageTokenInfo, expand_image_tokens

    info = ImageTokenInfo(image_token_id=7, num_image_tokens=6)

    def expand(hashes):
        images = ImageInputs(pixel_values=torch.zeros(len(hashes), 3, 2, 2), image_hashes=hashes)
        return expand_image_tokens([1, 7, 2, 7, 3][: 2 * len(hashes) + 1], images, info, 1000), images

    ids_a, images_a = expand([11, 22])
    assert ids_a == expand([11, 22])[0]
    assert ids_a != expand([11, 23])[0]
    assert len(ids_a) == 3 + 2 * 6 and images_a.image_offsets == [1, 8]
    assert ids_a[1:7] == (images_a.pad_values * 2)[:6]
    with pytest.raises(ValueError, match="image token"):
        expand_image_tokens([1, 2], ImageInputs(torch.zeros(1, 3, 2, 2), [5]), info, 1000)


def test_chunk_boundaries_inside_an_image(llava_engine, make_llava_engine):
    """Chunked prefill splits an image's rows across chunks; the output is unchanged."""
    whole = llava_engine.generate(image_prompt(2), GREEDY, image_data=[png_data_url(5), png_data_url(6)])
    chunked = make_llava_engine(scheduler={"chunked_prefill_size": 7}).generate(
        image_prompt(2), GREEDY, image_data=[png_data_url(5), png_data_url(6)]
    )
    assert chunked["output_ids"] == whole["output_ids"]


def test_image_request_longer_than_the_pool_is_aborted(make_llava_engine):
    from framework.multimodal import IMAGE_TOO_LONG_MESSAGE

    engine = make_llava_engine(cache={"max_total_tokens": NUM_IMAGE_TOKENS + 10})
    out = engine.generate(image_prompt(), GREEDY, image_data=png_data_url(1))
    assert out["meta_info"]["finish_reason"] == {"type": "abort", "message": IMAGE_TOO_LONG_MESSAGE}
    assert out["output_ids"] == []
    assert_no_leak(engine)
    # A text request still runs.
    assert len(engine.generate("Hello", GREEDY)["output_ids"]) == 8


@pytest.mark.parametrize(
    "prompt, image_data, error",
    [
        (image_prompt(1), [png_data_url(1)] * 2, "1 image token"),
        ("no image here", png_data_url(1), "0 image token"),
        (image_prompt(1), "http://example.com/cat.png", "not fetched"),
        (image_prompt(1), "not base64 !!", "neither an existing file nor valid base64"),
        (image_prompt(1), base64.b64encode(b"not an image").decode(), "not a readable image"),
        (image_prompt(1), 42, "must be a non-empty string"),
        (image_prompt(1), None, "for 0 image(s)"),  # the token would go in as text
        (image_prompt(1), [], "for 0 image(s)"),  # an empty list is no image
        (image_prompt(1), PNG_BOMB, "DecompressionBombError"),
        (image_prompt(1), base64.b64encode(b"P6\n").decode(), "not a readable image"),  # Pillow: ValueError
    ],
)
def test_bad_image_input(llava_engine, prompt, image_data, error):
    """Raised as ValueError (the docstring's promise), not answered as an aborted result."""
    with pytest.raises(ValueError) as caught:
        llava_engine.generate(prompt, GREEDY, image_data=image_data)
    assert error in str(caught.value)


def test_empty_image_list_is_no_image(llava_engine):
    out = llava_engine.generate("Hello", GREEDY, image_data=[])
    assert len(out["output_ids"]) == GREEDY["max_new_tokens"]
    outs = llava_engine.generate(["Hello", image_prompt()], GREEDY, image_data=[[], png_data_url(1)])
    assert [len(o["output_ids"]) for o in outs] == [GREEDY["max_new_tokens"]] * 2


def test_long_thin_image_is_not_resized_whole(monkeypatch):
    """A 1 x 200000 image (a few hundred bytes of PNG) becomes its center crop without first being
    resized whole (to 32 x 6.4 * 10^6 pixels: seconds and gigabytes for a 1 x 10^6 one)."""
    from PIL import Image

    from framework.images import ImageProcessor, open_image

    sizes = []
    resize = Image.Image.resize

    def spy(self, size, *args, **kwargs):
        sizes.append(size)
        return resize(self, size, *args, **kwargs)

    monkeypatch.setattr(Image.Image, "resize", spy)
    processor = ImageProcessor(IMAGE_SIZE)
    assert processor.pixels(open_image(png_of_size(1, 200_000))).shape == (3, IMAGE_SIZE, IMAGE_SIZE)
    assert max(w * h for w, h in sizes) <= IMAGE_SIZE * IMAGE_SIZE

    # The same pixels as resizing the whole image and cropping its center (CLIP's processor).
    w, h = 50, 300
    yy, xx = np.mgrid[0:h, 0:w]
    image = Image.fromarray(np.stack([xx * 5, yy * 255 // h, (xx + yy) % 256], -1).astype(np.uint8))
    whole = resize(image, (IMAGE_SIZE, round(h * IMAGE_SIZE / w)), Image.Resampling.BICUBIC)
    top = (whole.size[1] - IMAGE_SIZE) // 2
    crop = torch.tensor(np.asarray(whole.crop((0, top, IMAGE_SIZE, top + IMAGE_SIZE)))).permute(2, 0, 1) / 255.0
    std = torch.tensor(processor.std).reshape(3, 1, 1)
    expected = (crop - torch.tensor(processor.mean).reshape(3, 1, 1)) / std
    assert torch.allclose(processor.pixels(image), expected, atol=1.01 / 255 / std.min().item())


def test_text_model_refuses_images(make_engine):
    with pytest.raises(ValueError, match="does not take images"):
        make_engine().generate("Hello", GREEDY, image_data=png_data_url(1))


# -- over HTTP: images, weight updates and the profiler on one server ------------------------------

POOL_TOKENS = 60  # room for one image request, not for three images


@pytest.fixture(scope="module")
def llava_server(llava_folder, tmp_path_factory):
    from tests.conftest_server import running_server, tiny_server_args

    profile_dir = tmp_path_factory.mktemp("profiles")
    args = tiny_server_args(llava_folder) + [
        "--cache.max-total-tokens", str(POOL_TOKENS), "--server.profile-dir", str(profile_dir),
    ]
    with running_server(args, tmp_path_factory.mktemp("llava-server") / "server.log") as srv:
        srv.profile_dir = profile_dir
        yield srv


@pytest.fixture(scope="module")
def http(llava_server):
    import httpx

    with httpx.Client(base_url=llava_server.url, timeout=60.0) as client:
        yield client


def post_generate(http, image_data, prompt=None, **sampling):
    body = {"text": prompt or image_prompt(), "image_data": image_data, "sampling_params": {**GREEDY, **sampling}}
    return http.post("/generate", json=body)


def assert_server_idle(http):
    stats = http.get("/get_server_info").json()["scheduler_stats"]
    assert stats["kv_available"] + stats["kv_evictable"] == stats["max_total_num_tokens"]
    assert stats["req_slots_free"] == stats["req_slots_total"]


def test_http_image_requests_share_the_cache_by_image(http, llava_tokenizer):
    prefix_len = llava_tokenizer.encode(image_prompt()).index(llava_tokenizer.convert_tokens_to_ids(IMAGE_TOKEN))
    first = post_generate(http, png_data_url(11))
    assert first.status_code == 200, first.text
    again = post_generate(http, png_data_url(11)).json()
    other = post_generate(http, png_data_url(12)).json()
    assert again["meta_info"]["cached_tokens"] >= prefix_len + NUM_IMAGE_TOKENS
    assert again["output_ids"] == first.json()["output_ids"]
    assert other["meta_info"]["cached_tokens"] <= prefix_len
    assert_server_idle(http)


def test_http_image_request_longer_than_the_pool(http):
    from framework.multimodal import IMAGE_TOO_LONG_MESSAGE

    resp = post_generate(http, [png_data_url(i) for i in range(3)], prompt=image_prompt(3))
    assert resp.status_code == 400
    assert resp.json()["error"]["message"] == IMAGE_TOO_LONG_MESSAGE
    assert_server_idle(http)


@pytest.mark.parametrize(
    "body, error",
    [
        ({"text": image_prompt(), "image_data": "bm90IGFuIGltYWdl"}, "not a readable image"),
        ({"text": image_prompt(), "image_data": [png_data_url(1)] * 2}, "1 image token"),
        ({"text": [image_prompt()] * 2, "image_data": [png_data_url(1)]}, "one entry per prompt"),
        ({"text": image_prompt(), "image_data": 7}, "must be a non-empty string"),
        ({"text": image_prompt()}, "for 0 image(s)"),
        ({"text": image_prompt(), "image_data": []}, "for 0 image(s)"),
        ({"text": [image_prompt()] * 2, "image_data": [[], png_data_url(1)]}, "for 0 image(s)"),
        ({"text": image_prompt(), "image_data": PNG_BOMB}, "DecompressionBombError"),
        ({"text": image_prompt(), "image_data": "UDYK"}, "not a readable image"),  # "P6\n": Pillow's ValueError
    ],
)
def test_http_bad_image_input(http, body, error):
    resp = http.post("/generate", json=body)
    assert resp.status_code == 400 and error in resp.json()["error"]["message"], resp.text
    assert post_generate(http, png_data_url(1)).status_code == 200
    assert_server_idle(http)


def test_http_empty_image_list_is_no_image(http):
    resp = http.post("/generate", json={"text": "Hello", "image_data": [], "sampling_params": GREEDY})
    assert resp.status_code == 200 and len(resp.json()["output_ids"]) == GREEDY["max_new_tokens"], resp.text


def test_http_update_weights_from_disk(http, llava_folder, llava_tokenizer, tmp_path_factory):
    from framework.engine import Engine
    from tests.conftest import tiny_settings

    new_folder = build_llava_folder(tmp_path_factory.mktemp("tiny-llava-b"), llava_tokenizer, seed=1)
    with Engine(tiny_settings(new_folder)) as fresh:
        expected = fresh.generate(image_prompt(), GREEDY, image_data=png_data_url(13))["output_ids"]
    before = post_generate(http, png_data_url(13)).json()["output_ids"]
    assert before != expected

    resp = http.post("/update_weights_from_disk", json={"model_path": new_folder})
    assert resp.status_code == 200 and resp.json()["success"] is True, resp.text
    assert post_generate(http, png_data_url(13)).json()["output_ids"] == expected
    assert http.get("/get_model_info").json()["model_path"] == new_folder

    for body, error in [
        ({"model_path": str(tmp_path_factory.mktemp("nothing") / "missing")}, "Failed to load weights"),
        ({"model_path": 3}, "model_path"),
        ({"model_path": new_folder, "load_format": "pt"}, "load_format"),
        ({"model_path": new_folder, "load_format": "gguf"}, "holds no gguf weights"),
    ]:
        resp = http.post("/update_weights_from_disk", json=body)
        assert resp.status_code == 400 and error in resp.text, resp.text
    assert post_generate(http, png_data_url(13)).json()["output_ids"] == expected
    # Back to the first weights, through the reference's older route name.
    resp = http.post("/update_weights", json={"model_path": llava_folder})
    assert resp.status_code == 200, resp.text
    assert post_generate(http, png_data_url(13)).json()["output_ids"] == before
    assert_server_idle(http)


def test_http_profile(http, llava_server):
    assert http.post("/stop_profile").status_code == 400
    assert http.post("/start_profile").status_code == 200
    assert http.post("/start_profile").status_code == 400
    assert post_generate(http, png_data_url(14)).status_code == 200
    resp = http.get("/stop_profile")
    assert resp.status_code == 200, resp.text
    traces = list(llava_server.profile_dir.iterdir())
    assert len(traces) == 1 and traces[0].stat().st_size > 0 and str(traces[0]) in resp.text


def test_llava_serves_in_bfloat16_with_packed_weights(llava_folder):
    """bf16 with the packed weights on (the default): the language model's linear layers get
    their packed copies (the llava wrapper has no LM head of its own) and a request with an image
    is served."""
    from framework.engine import Engine

    with Engine(tiny_settings(llava_folder, model={"path": llava_folder, "dtype": "bfloat16"})) as engine:
        runner = engine.scheduler.worker.runner
        lm = runner.model.language_model
        if runner.packed_weights:
            assert lm.packed_lm_head is not None
            assert lm.model.layers[0].self_attn.qkv_proj.packed is not None
        out = engine.generate(image_prompt(), GREEDY, image_data=png_data_url(1))
        assert len(out["output_ids"]) == GREEDY["max_new_tokens"]
        assert_no_leak(engine)
