import ctypes
import unittest

from pdrouter_kv import cuda

try:
    import torch
    HAVE_GPU = torch.cuda.is_available()
except ImportError:
    HAVE_GPU = False


class CudaPointerTest(unittest.TestCase):
    def test_host_memory_is_not_cuda(self):
        b = ctypes.create_string_buffer(4096)
        self.assertFalse(cuda.is_cuda_pointer(ctypes.addressof(b)))

    def test_bad_pointers_are_rejected(self):
        for bad, exc in ((0, ValueError), (-5, ValueError), ("0x10", TypeError), (True, TypeError)):
            with self.assertRaises(exc):
                cuda.is_cuda_pointer(bad)

    def test_without_driver_ipc_region_says_so(self):
        if cuda.available():
            self.skipTest("a CUDA driver is present: covered by the GPU test")
        for call in (lambda: cuda.ipc_region(0x1000), lambda: cuda.register_body(0x1000, 16)):
            with self.assertRaises(cuda.CudaUnavailable) as cm:
                call()
            self.assertIn("CUDA", str(cm.exception))

    @unittest.skipUnless(HAVE_GPU, "GPU-only")
    def test_torch_tensor_region_matches_torch_ipc(self):
        seg = torch.empty(8 << 20, dtype=torch.uint8, device="cuda")
        view = seg[4096:]
        ptr = view.data_ptr()
        self.assertTrue(cuda.is_cuda_pointer(ptr))
        r = cuda.ipc_region(ptr)
        st = view.untyped_storage()
        # torch's own IPC view: (device, handle, size, offset in the allocation, ...)
        shared = st._share_cuda_()
        # torch prefixes the cudaIpcMemHandle with its own type bytes.
        self.assertEqual(len(r.handle), cuda.HANDLE_SIZE)
        self.assertTrue(shared[1].endswith(r.handle), (shared[1], r.handle))
        self.assertEqual(r.offset, ptr - r.base)
        self.assertEqual(r.base + shared[3], st.data_ptr())
        self.assertEqual(r.device, torch.cuda.current_device())
        self.assertGreaterEqual(r.size, r.offset + view.numel())
        with self.assertRaises(ValueError):
            cuda.ipc_region(ctypes.addressof(ctypes.create_string_buffer(64)))
        body = cuda.register_body(ptr, 4096)
        self.assertEqual(len(body), 1 + 8 + 8 + 4 + cuda.HANDLE_SIZE + 8)
        self.assertEqual(body[0], 1)
        self.assertEqual(int.from_bytes(body[1:9], "little"), ptr)
        self.assertEqual(body[21:21 + cuda.HANDLE_SIZE], r.handle)
        self.assertEqual(int.from_bytes(body[-8:], "little"), r.offset)
        with self.assertRaises(ValueError):
            cuda.register_body(ptr, r.size)  # past the allocation


if __name__ == "__main__":
    unittest.main()
