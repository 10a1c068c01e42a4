package router

import "github.com/pdrouter/pdrouter/balancer"

// Manager is the worker manager behind /workers. Service discovery adds and
// removes workers through it, exactly as POST and DELETE /workers do.
func (s *Server) Manager() *balancer.Manager { return s.manager }
