"""The diffusers transformer classes seqpar refuses, each with the reason (:data:`REFUSED`).

A refusal names what stops seqpar from running the class exactly -- token mixing outside attention
(convolutions over the grid, linear attention), attention over a layout that is not one sequence
split by position (frames at each pixel, per-sample packing, key/value caches, pairwise biases), a
mask built from whole and local lengths together -- or, where nothing so specific was found, that no
shard plan has been declared and checked for it yet. Every class diffusers ships is either here or
in :data:`seqpar.integrations.diffusers.families.FAMILIES` (the diffusers zoo's test checks it).
"""

from __future__ import annotations

NOPLAN = ("seqpar has no shard plan declared for it yet (where its sequences are split and leave, which attention "
          "modules are self- or cross-attention), so it is not checked against itself unsharded")
REFUSED: dict[str, str] = {
    "AceStepTransformer1DModel": (
        "its audio tokens pass 1-D convolutions over the sequence at the edges and it runs causal and "
        "sliding-window attention; " + NOPLAN),
    "AllegroTransformer3DModel": (
        "its RoPE arrives as frequency tables plus per-token grid positions in one nested tuple "
        "(image_rotary_emb), which seqpar's plan does not split; its video mask covers the whole sequence"),
    "AnyFlowFARTransformer3DModel": (
        "it generates frames autoregressively with a key/value cache and causal chunk masks "
        "(AnyFlowCausalAttnProcessor), which seqpar does not shard"),
    "AnyFlowTransformer3DModel": (
        "its attention switches between full and causal chunk masks per call (AnyFlowAttnProcessor with a"
        " key/value cache); " + NOPLAN),
    "BriaFibo2Transformer2DModel": (
        "a perceiver resampler over the text and causal context latents enter its blocks; " + NOPLAN),
    "BriaFiboTransformer2DModel": (
        "it injects each text-encoder layer's states (text_encoder_layers) into its own block; " + NOPLAN),
    "ConsisIDTransformer3DModel": (
        "CogVideoX plus identity conditioning: a facial feature extractor and perceiver cross-attention "
        "inserted between blocks; " + NOPLAN),
    "Cosmos3OmniTransformer": (
        "a packed multimodal mixture-of-transformers over text, vision, sound and action tokens placed by"
        " index lists (sequence_indexes) into one row: seqpar has no plan for the packing"),
    "DreamLiteTransformer2DModel": (
        "a generic 2-D transformer variant (continuous inputs, convolutional projection in and out over "
        "the image grid); " + NOPLAN),
    "EasyAnimateTransformer3DModel": (
        "its blocks run a 3-D convolution over the video grid between attention layers in some "
        "configurations and concatenate two text encoders' streams; " + NOPLAN),
    "ErnieImageTransformer2DModel": (
        "it packs text of per-sample lengths (text_lens) before the image in a single stream; " + NOPLAN),
    "Flux3Transformer2DModel": (
        "it adds image-conditioning tokens with their own ids and a target timestep mode to Flux's "
        "layout; " + NOPLAN),
    "GlmImageTransformer2DModel": (
        "it attends to key/value caches of prior image tokens (kv_caches); " + NOPLAN),
    "HeliosTransformer3DModel": (
        "its _cp_plan splits and gathers around every attention and feed-forward module (not one sharded "
        "region), and it conditions on history latents at several resolutions; " + NOPLAN),
    "HiDreamImageTransformer2DModel": (
        "its MoE feed-forward routes tokens with a load-balancing loss over the whole sequence, and its "
        "text streams (T5 and Llama layers) are concatenated per block; " + NOPLAN),
    "HunyuanDiT2DModel": (
        "its blocks take long skip connections from the first half of the network and mask padded text "
        "through two encoders' streams; " + NOPLAN),
    "HunyuanImageTransformer2DModel": (
        "HunyuanVideo's text refiner pools the whole prompt and its joint mask mixes whole-prompt and "
        "shard lengths (see HunyuanVideoTransformer3DModel)"),
    "HunyuanVideo15Transformer3DModel": (
        "HunyuanVideo's text refiner pools the whole prompt and its joint mask mixes whole-prompt and "
        "shard lengths (see HunyuanVideoTransformer3DModel)"),
    "HunyuanVideoFramepackTransformer3DModel": (
        "HunyuanVideo's text refiner and joint mask (see HunyuanVideoTransformer3DModel), plus history "
        "latents at other resolutions patched and prepended per sample"),
    "HunyuanVideoTransformer3DModel": (
        "its text refiner pools the text over the whole prompt, and its joint attention mask is built "
        "from the whole prompt's length next to the shard's: text sharded, the mask would be wrong "
        "(seqpar does not replicate the text stream yet)"),
    "Ideogram4Transformer2DModel": (
        "its single stream takes position ids, segment ids and an indicator per token from the pipeline "
        "(packed segments); " + NOPLAN),
    "JoyImageEditPlusTransformer3DModel": (
        "it packs each sample's images of per-sample shapes (shape_list) into one sequence, a layout "
        "seqpar's plan cannot split by position"),
    "JoyImageEditTransformer3DModel": (
        "an image-editing transformer over reference and target latents concatenated per sample; " + NOPLAN),
    "Kandinsky5Transformer3DModel": (
        "it takes sparse attention parameters (sparse_params: block-sparse masks over the video) and "
        "per-token RoPE positions from the pipeline; " + NOPLAN),
    "Kandinsky6SRTransformer3DModel": (
        "a super-resolution transformer with temporal blocks across frames; " + NOPLAN),
    "Kandinsky6Transformer3DModel": (
        "it encodes text and audio with encoder blocks and fuses them into the video decoder per token "
        "type (visual_token_type_ids); " + NOPLAN),
    "Krea2Transformer2DModel": (
        "its text fusion blocks and final layer take position ids per token from the pipeline; " + NOPLAN),
    "LTX2VideoTransformer3DModel": (
        "it denoises audio and video together (two sequences with cross-modal attention and per-modality "
        "timesteps); its _cp_plan shards the text for cross-attention, which seqpar keeps whole, and the "
        "audio stream has no plan"),
    "LatteTransformer3DModel": (
        "its temporal blocks attend across frames at each spatial position (the tokens re-laid [B*H*W, F,"
        " C] between blocks): sharding the frames x positions sequence would cut those groups"),
    "LongCatAudioDiTTransformer": (
        "its audio tokens pass convolutions over the sequence (latent conditioning); " + NOPLAN),
    "Lumina2Transformer2DModel": (
        "it packs each sample's text and image into a row of its own length (joint rows built sample by "
        "sample after two refiners), a layout seqpar's plan cannot split by position"),
    "LuminaNextDiT2DModel": (
        "its patch embedder pads every image to the batch's longest and returns that padding as a mask "
        "over the whole sequence, which seqpar's plan does not split"),
    "MiniMaxH3Transformer3DModel": (
        "it denoises audio and video in one packed sequence placed by index tensors (video_indices, "
        "audio_indices, text_indices); its _cp_plan gathers two outputs, seqpar supports one exit"),
    "MiniMaxMusic3RVQDepthDecoder": (
        "a causal depth decoder over the few residual-vector-quantizer codes of one frame: no long "
        "sequence to shard"),
    "MiniMaxMusic3Transformer1DModel": (
        "its audio tokens pass convolutions over the sequence; " + NOPLAN),
    "MochiTransformer3DModel": (
        "its attention drops each sample's padding text tokens before attending (one "
        "scaled_dot_product_attention per sample over a data-dependent length, MochiAttnProcessor2_0)"),
    "MotifVideoTransformer3DModel": (
        "its patch embedding and text mask follow HunyuanVideo's (text refiner, whole-prompt mask "
        "lengths); " + NOPLAN),
    "NucleusMoEImageTransformer2DModel": (
        "its MoE feed-forward routes tokens with statistics over the whole sequence; " + NOPLAN),
    "OmniGenTransformer2DModel": (
        "a language-model-style transformer over interleaved text ids and image latents with its own [B, "
        "S, S] attention mask and position ids built by the pipeline: not a key mask seqpar shards"),
    "PRXTransformer2DModel": (
        "its attention takes a mask built over text and image together; " + NOPLAN),
    "PriorTransformer": (
        "a prior over a handful of embedding tokens (text, time, image embedding, a learned query) with a"
        " causal mask built over the whole concatenation: there is no long sequence to shard"),
    "QwenImage21Transformer2DModel": (
        "it runs with a key/value cache and causal masks over image chunks (kv_cache_mode); " + NOPLAN),
    "RFD4ProteinaTransformer": (
        "its attention is biased by pairwise features [B, N, N, C] (RFD4ProteinaPairAttention): an N x N "
        "tensor per layer that seqpar would have to shard in two dimensions"),
    "SanaTransformer2DModel": (
        "its blocks mix neighbouring tokens outside attention (GLUMBConv: a depthwise 3x3 convolution "
        "over the image grid in the feed-forward) and attend linearly (SanaLinearAttnProcessor2_0, no "
        "scaled_dot_product_attention); a sharded grid would need a halo seqpar does not exchange"),
    "SanaVideoTransformer3DModel": (
        "its blocks mix neighbouring tokens outside attention (GLUMBConv convolutions over the video "
        "grid) and attend linearly (SanaLinearAttnProcessor3_0), which seqpar does not shard"),
    "SanaWMLTX2RefinerTransformer3DModel": (
        "it refines audio and video together with a key/value cache and causal masks over chunks; seqpar "
        "has no plan for its two streams"),
    "SanaWMTransformer3DModel": (
        "its camera-control blocks mix tokens outside attention (convolutions over the video grid) and "
        "attend chunk-causally over frames with a cache; seqpar does not shard them"),
    "StableAudio3DiTModel": (
        "its local conditioning enters through convolutions over the audio sequence; " + NOPLAN),
    "StableAudioDiTModel": (
        "it prepends the global conditioning to the audio tokens and projects them with 1-D convolutions "
        "at the edges; " + NOPLAN),
    "T5FilmDecoder": (
        "a T5 decoder over note tokens with causal and encoder masks built over the whole sequence in the"
        " model: no long sequence to shard"),
    "Transformer2DModel": (
        "the legacy generic 2-D transformer (continuous, vector-quantized or patched inputs, chosen by "
        "config); " + NOPLAN),
    "TransformerTemporalModel": (
        "it attends across frames at each spatial position (the sequence is the frames of one pixel, a "
        "handful of tokens): nothing long to shard"),
    "WanAnimate2Transformer3DModel": (
        "it runs with a key/value cache over condition latents at other grid sizes (offset_grid_sizes, "
        "reference_grid_sizes); " + NOPLAN),
    "WanAnimateTransformer3DModel": (
        "its face blocks cross-attend per frame to motion features from a convolutional encoder, "
        "re-laying the video tokens by frame; " + NOPLAN),
    "ZImageTransformer2DModel": (
        "it packs each sample's caption and image patches of per-sample sizes into padded rows (lists of "
        "tensors per sample); " + NOPLAN),
}
"""The classes seqpar refuses, by class name, with the reason."""
