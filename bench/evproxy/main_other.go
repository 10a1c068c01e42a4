//go:build !linux

// Command evproxy is make bench's epoll event-loop proxy baseline; see
// main.go. It is built on Linux's epoll and exists only there.
package main

import (
	"fmt"
	"os"
)

func main() {
	fmt.Fprintln(os.Stderr, "evproxy: Linux only (it is built on epoll)")
	os.Exit(2)
}
