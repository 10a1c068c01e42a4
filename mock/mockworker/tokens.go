package mockworker

import (
	"hash/fnv"
	"strconv"
	"strings"
)

// The mock "model": output token ids are a deterministic function of the
// prompt (and the choice index), so identical prompts give identical text on
// any worker and a router mixing up responses is visible.

const vocabSize = 32000

func promptSeed(prompt []byte, choice int) uint64 {
	h := fnv.New64a()
	h.Write(prompt)
	return h.Sum64() ^ uint64(choice)*0x9E3779B97F4A7C15
}

// Mix is splitmix64's finalizer: nearby seeds give unrelated values. The
// engine simulator derives its page contents with it too.
func Mix(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xBF58476D1CE4E5B9
	x ^= x >> 27
	x *= 0x94D049BB133111EB
	return x ^ x>>31
}

// outputIDs returns the first n output token ids for seed.
func outputIDs(seed uint64, n int) []int {
	ids := make([]int, n)
	for i := range ids {
		ids[i] = int(Mix(seed+uint64(i+1)*0x9E3779B97F4A7C15) % vocabSize)
	}
	return ids
}

func tokenText(id int) string { return " tok" + strconv.Itoa(id) }

// tokenLogprob is a deterministic log-probability in (-1, 0).
func tokenLogprob(id int) float64 { return -float64(id%997+1) / 1000 }

// wordIDs tokenizes text the mock way: one token per whitespace-separated word.
func wordIDs(text string) []int {
	words := strings.Fields(text)
	ids := make([]int, len(words))
	for i, w := range words {
		h := fnv.New32a()
		h.Write([]byte(w))
		ids[i] = int(h.Sum32() % vocabSize)
	}
	return ids
}
