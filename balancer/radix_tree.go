package balancer

import (
	"bytes"
	"container/heap"
	"slices"
	"strings"
	"unsafe"
)

// radixTree is cache_aware's approximate model of the engines' prefix
// caches: a byte-level radix tree whose nodes record which tenants (workers,
// by small id) were sent that prefix and when (a logical clock). Its
// memory, estimated from the nodes' real sizes, stays under limit bytes: an
// insert that crosses it evicts least recently used leaves down to 90 %, so
// eviction cost is amortised over many inserts. Not safe for concurrent use.
type radixTree struct {
	root  radixNode
	bytes int64 // estimated heap bytes of all nodes
	limit int64
	tick  uint64
}

type radixNode struct {
	edge     string // own copy, never a slice of a request
	keys     []byte // first byte of each child's edge, scanned with IndexByte
	children []*radixNode
	tenants  []uint32
	parent   *radixNode
	last     uint64 // tick of the last insert through this node
}

// nodeSize is what a node costs besides its edge and slice backing arrays.
var nodeSize = allocSize(int(unsafe.Sizeof(radixNode{})))

// cost is the node's heap footprint: each allocation rounded up the way
// Go's allocator rounds it, so the bound holds for real memory.
func (n *radixNode) cost() int64 {
	return nodeSize + allocSize(len(n.edge)) + allocSize(cap(n.keys)) + allocSize(8*cap(n.children)) + allocSize(4*cap(n.tenants))
}

// allocSize approximates (from above, for the sizes nodes use) Go's size
// classes: 8, then steps of 16 to 256, 32 to 512, 64 to 1 KiB, 256 to 2 KiB,
// 1 KiB to 32 KiB, then whole 8 KiB pages.
func allocSize(n int) int64 {
	step := 8192
	switch {
	case n == 0:
		return 0
	case n <= 8:
		return 8
	case n <= 256:
		step = 16
	case n <= 512:
		step = 32
	case n <= 1024:
		step = 64
	case n <= 2048:
		step = 256
	case n <= 32768:
		step = 1024
	}
	return int64((n + step - 1) / step * step)
}

func newRadixTree(limit int64) *radixTree {
	t := &radixTree{limit: limit}
	t.bytes = t.root.cost()
	return t
}

// match walks the longest prefix of text present in the tree and returns
// how many bytes matched and the deepest node reached (root if none).
func (t *radixTree) match(text string) (int, *radixNode) {
	n, i := &t.root, 0
	for i < len(text) {
		k := bytes.IndexByte(n.keys, text[i])
		if k < 0 {
			break
		}
		c := n.children[k]
		l := commonPrefix(c.edge, text[i:])
		i += l
		n = c // on a partial edge match c's tenants still share text[:i]
		if l < len(c.edge) {
			break
		}
	}
	return i, n
}

// insert records that tenant was sent text, then enforces the byte limit.
func (t *radixTree) insert(text string, tenant uint32) {
	t.tick++
	n, i := &t.root, 0
	for i < len(text) {
		k := bytes.IndexByte(n.keys, text[i])
		if k < 0 {
			t.addChild(n, &radixNode{edge: strings.Clone(text[i:]), tenants: []uint32{tenant}, last: t.tick})
			break
		}
		c := n.children[k]
		l := commonPrefix(c.edge, text[i:])
		if l < len(c.edge) {
			c = t.split(n, k, l)
		}
		t.touch(c, tenant)
		i += l
		n = c
	}
	if t.bytes > t.limit {
		t.evict(t.limit / 10 * 9)
	}
}

func (t *radixTree) touch(n *radixNode, tenant uint32) {
	n.last = t.tick
	if !slices.Contains(n.tenants, tenant) {
		t.bytes -= n.cost()
		n.tenants = append(n.tenants, tenant)
		t.bytes += n.cost()
	}
}

func (t *radixTree) addChild(p, c *radixNode) {
	c.parent = p
	t.bytes -= p.cost()
	p.keys = append(p.keys, c.edge[0])
	p.children = append(p.children, c)
	t.bytes += p.cost() + c.cost()
}

// split cuts p.children[k] after l bytes and returns the new upper half.
func (t *radixTree) split(p *radixNode, k, l int) *radixNode {
	c := p.children[k]
	t.bytes -= c.cost()
	mid := &radixNode{edge: strings.Clone(c.edge[:l]), tenants: slices.Clone(c.tenants), parent: p, last: c.last}
	c.edge = strings.Clone(c.edge[l:]) // copies, so neither half pins the other's bytes
	c.parent = mid
	mid.keys = []byte{c.edge[0]}
	mid.children = []*radixNode{c}
	p.children[k] = mid
	t.bytes += c.cost() + mid.cost()
	return mid
}

func (t *radixTree) removeChild(p, c *radixNode) {
	k := slices.Index(p.children, c)
	t.bytes -= p.cost()
	p.keys = slices.Delete(p.keys, k, k+1)
	p.children = slices.Delete(p.children, k, k+1)
	t.bytes += p.cost()
}

// evict removes least recently used leaves until bytes ≤ target.
func (t *radixTree) evict(target int64) {
	var h leafHeap
	stack := []*radixNode{&t.root}
	for len(stack) > 0 {
		n := stack[len(stack)-1]
		stack = stack[:len(stack)-1]
		if len(n.children) == 0 && n != &t.root {
			h = append(h, n)
		}
		stack = append(stack, n.children...)
	}
	heap.Init(&h)
	for t.bytes > target && len(h) > 0 {
		n := heap.Pop(&h).(*radixNode)
		p := n.parent
		t.removeChild(p, n)
		t.bytes -= n.cost()
		if len(p.children) == 0 && p != &t.root {
			heap.Push(&h, p)
		}
	}
}

// dropTenants removes tenants from every node and prunes nodes left with
// none (a child's tenants are a subset of its parent's, so whole subtrees go).
func (t *radixTree) dropTenants(dead map[uint32]bool) {
	var walk func(n *radixNode)
	walk = func(n *radixNode) {
		for i := len(n.children) - 1; i >= 0; i-- {
			c := n.children[i]
			t.bytes -= c.cost()
			c.tenants = slices.DeleteFunc(c.tenants, func(id uint32) bool { return dead[id] })
			t.bytes += c.cost()
			if len(c.tenants) == 0 {
				t.removeChild(n, c)
				t.bytes -= subtreeCost(c)
				continue
			}
			walk(c)
		}
	}
	walk(&t.root)
}

func subtreeCost(n *radixNode) int64 {
	s := n.cost()
	for _, c := range n.children {
		s += subtreeCost(c)
	}
	return s
}

// commonPrefix compares eight bytes at a time where it can.
func commonPrefix(a, b string) int {
	n := min(len(a), len(b))
	i := 0
	for ; i+8 <= n; i += 8 {
		if *(*uint64)(unsafe.Pointer(unsafe.StringData(a[i:]))) != *(*uint64)(unsafe.Pointer(unsafe.StringData(b[i:]))) {
			break
		}
	}
	for ; i < n && a[i] == b[i]; i++ {
	}
	return i
}

type leafHeap []*radixNode

func (h leafHeap) Len() int           { return len(h) }
func (h leafHeap) Less(i, j int) bool { return h[i].last < h[j].last }
func (h leafHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *leafHeap) Push(x any)        { *h = append(*h, x.(*radixNode)) }
func (h *leafHeap) Pop() any {
	old := *h
	n := old[len(old)-1]
	*h = old[:len(old)-1]
	return n
}
