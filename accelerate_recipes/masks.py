"""Attention masks built without reading the padding back on the host (transformers' sdpa and eager
builders)."""

from transformers import AttentionMaskInterface


def always_build_attention_masks() -> None:
    """Have transformers build every padded batch's attention mask without first reading the padding
    on the host.

    Its stock sdpa and eager mask builders first ask `padding_mask.all()`, to drop the mask of a
    batch without padding; on a GPU that answer is a read from the device in every forward pass,
    which stalls the queue. With a padding mask given, the mask is now always built: a padded batch
    gets the very mask it got before, an unpadded one an all-true mask (the same attention). Models
    that build their masks another way (DeBERTa, say) keep doing so.
    """

    def without_padding_check(stock):
        def build_mask(*args, attention_mask=None, **kwargs):
            if attention_mask is not None:
                kwargs.update(allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
            return stock(*args, attention_mask=attention_mask, **kwargs)

        build_mask.stock = stock
        return build_mask

    for name in ("sdpa", "eager"):
        stock = AttentionMaskInterface()[name]
        if not hasattr(stock, "stock"):  # not already replaced in this process
            AttentionMaskInterface.register(name, without_padding_check(stock))
