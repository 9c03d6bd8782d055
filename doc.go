// Package etcdsync provides distributed coordination primitives on etcd: a
// Session (a lease kept alive in the background), a Mutex and an Election.
//
// It mirrors go.etcd.io/etcd/client/v3/concurrency, so switching is a change
// of import path plus WithTTL taking a time.Duration, and it writes the same
// keys (NAME/<lease-hex>), so a fleet that mixes the two still excludes each
// other. What it adds:
//
//   - Loss signals: Session.Done closes no later than the server can expire
//     the lease, even when etcd is unreachable (the session keeps a deadline
//     from the send time of the last acknowledged keepalive); Mutex.Done
//     closes when the hold ends for any reason, and Err says why.
//   - Fencing: Rev is the create revision of the held key, strictly increasing
//     from one holder to the next; Do runs operations only while the hold is
//     current and returns ErrNotHeld otherwise.
//   - Exclusion between two Mutex values on one Session, fenced releases, no
//     key left behind by a cancelled Lock, and a waiter that notices at once
//     when its own key vanishes.
//   - A cheap queue: each waiter watches only its predecessor, a release wakes
//     one waiter, and the next waiter owns the lock with no further RPC once
//     the predecessor's delete arrives.
//
// Only direct children NAME/<hex> of a name take part in its queue, so a lock
// on "/a/b" never blocks a lock on "/a".
package etcdsync
