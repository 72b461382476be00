"""A stand-in for SGLang's KV pool in attention unit tests: one layer's key and value buffers."""


class FakeKVPool:
    def __init__(self, k_cache, v_cache):
        self.k_cache, self.v_cache = k_cache, v_cache

    def set_kv_buffer(self, layer, loc, k, v):
        self.k_cache[loc.loc], self.v_cache[loc.loc] = k, v

    def get_key_buffer(self, layer_id):
        return self.k_cache

    def get_value_buffer(self, layer_id):
        return self.v_cache
