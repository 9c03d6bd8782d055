package etcdtest

// What -short skips, for every module's tests: the tests that wait out a
// TTL or a lock delay, and those that need more than one member.

import "testing"

// SkipSlowInShort skips t under -short: it waits out TTLs or lock delays
// for seconds.
func SkipSlowInShort(t testing.TB) {
	t.Helper()
	if testing.Short() {
		t.Skip("waits out TTLs for seconds: runs without -short")
	}
}

// SkipClusterInShort skips t under -short when it needs a cluster of more
// than one member.
func SkipClusterInShort(t testing.TB, members int) {
	t.Helper()
	if members > 1 && testing.Short() {
		t.Skip("a cluster of more than one member: runs without -short")
	}
}
